"""Decisions: proposers (one file each, with their method spec), acceptance rules, speculation length.

Importing the package registers every method (``policies.registry``), so
``registered_methods()`` is complete wherever a policy is used.
"""

from specray.policies import draft_model, eagle, lookahead, medusa, prompt_lookup, redrafter, registry, suffix  # noqa: F401,E501  (registration)
