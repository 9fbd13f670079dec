"""Decisions: proposers (one file each), acceptance rules, speculation length."""
