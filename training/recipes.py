"""``specray train METHOD``: each method's recipe is found through its ``MethodSpec.recipe``.

No list is kept here: a method that names a recipe module (``policies/medusa.py`` names
``specray.training.medusa``) can be trained, and the recipes import ``training/base.py``,
never this module, so nothing imports in a circle.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Callable


def recipes() -> dict[str, Callable[[list[str]], int]]:
    """Method name -> its recipe's ``main(argv)``, for every registered method with one."""
    import specray.policies  # noqa: F401 - registers every method
    from specray.policies.registry import method_spec, registered_methods

    found = {}
    for name in registered_methods():
        module = method_spec(name).recipe
        if module is not None:
            found[name] = importlib.import_module(module).main
    return found


def main(argv: list[str] | None = None) -> int:
    known = recipes()
    # No -h here: `specray train eagle --help` shows the recipe's own options.
    p = argparse.ArgumentParser(prog="specray train", description="Train a draft head on a frozen target.",
                                add_help=False)
    p.add_argument("method", choices=sorted(known))
    args, rest = p.parse_known_args(argv)
    return known[args.method](rest)
