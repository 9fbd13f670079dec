"""Decisions: proposers (one file each, with their method spec), acceptance rules, speculation length.

Importing the package registers every method (``policies.registry``), so
``registered_methods()`` is complete wherever a policy is used.
"""

from specray.policies import (  # noqa: F401  (registration)
    dflash, draft_model, dspark, eagle, eagle3, lookahead, medusa, pard, prompt_lookup, redrafter, registry, suffix,
)
