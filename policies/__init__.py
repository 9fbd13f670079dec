"""Decisions: proposers (one file each), acceptance rules, speculation length.

Importing the package registers every proposer by name (``policies.base`` registry), so
``registered_methods()`` is complete wherever a policy is used.
"""

from specray.policies import draft_model, medusa, prompt_lookup  # noqa: F401  (registration)
