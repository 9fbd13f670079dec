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


# -- short heads for tests and benchmarks ------------------------------------------------------
QUICK_COMMON = dict(sequences=256, gen_len=64)
# EAGLE-3 kept cheap (about 1.5 CPU minutes on top of the shared data): 150 steps over 64-position
# windows with 4 self-fed passes, at lr 1e-2 against the target's distribution sharpened to
# temperature 0.25. Measured on the demo target (16 held-out prompts x 32 tokens): mean accepted
# length 2.62 for the fitted 8-node tree, 2.83 for an EAGLE-2 dynamic tree (top_k 4, depth 5, 16 tokens).
QUICK_RECIPES: dict[str, tuple[str, dict]] = {
    "medusa": ("train_medusa", dict(steps=300, tree_size=8)),
    "eagle": ("train_eagle", dict(steps=300, depth=5, tree_size=8)),
    "redrafter": ("train_redrafter", dict(steps=300, shapes=((4, 4),))),
    "eagle3": ("train_eagle3", dict(steps=150, lr=1e-2, label_temperature=0.25, width=64, unroll=4, depth=5,
                                    tree_size=8)),
}
"""Short recipes per method (a few CPU minutes for all four, the data built once): what
``tests/test_trained_heads.py`` trains on the demo target."""

README_COMMON = dict(sequences=1024, gen_len=128)
README_RECIPES: dict[str, tuple[str, dict]] = {
    "medusa": ("train_medusa", dict(steps=1500)),
    "eagle": ("train_eagle", dict(steps=2000)),
    "redrafter": ("train_redrafter", dict(steps=1000)),
    "eagle3": ("train_eagle3", dict(steps=1000, label_temperature=0.25, width=64)),
}
"""The recipes the README's measurements use (``specray train medusa``; ``specray train eagle
--steps 2000``; ``specray train redrafter``; ``specray train eagle3 --steps 1000
--label-temperature 0.25 --width 64``): about 15 CPU minutes for all four on a quiet machine,
the data built once. ``bench/selftune.py`` trains and caches these."""

RECIPES = {"quick": (QUICK_COMMON, QUICK_RECIPES), "readme": (README_COMMON, README_RECIPES)}


def train_by_recipe(method: str, target: str, tokenizer: str | None, out: str, recipe: str = "quick") -> dict:
    """Train ``method``'s head by a named recipe table (``RECIPES``) into ``out``; its report."""
    import specray.policies  # noqa: F401
    from specray.policies.registry import method_spec

    common, table = RECIPES[recipe]
    function, options = table[method]
    module = importlib.import_module(method_spec(method).recipe)
    return getattr(module, function)(target, out, tokenizer, **common, **options)


def cached_heads(target: str, tokenizer: str | None, root: str, methods, recipe: str = "quick") -> dict[str, str]:
    """Method -> a directory of its head for ``target`` by ``recipe``, trained the first time
    and cached under ``root`` (a head is written aside and renamed, so a cached one is whole)."""
    import os
    import shutil

    from specray.policies.checkpoint_files import measured_acceptance
    from specray.training.base import record_acceptance

    dirs = {}
    for method in methods:
        out = os.path.join(root, method)
        if not os.path.exists(os.path.join(out, "config.json")):
            partial = f"{out}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            train_by_recipe(method, target, tokenizer, partial, recipe)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(partial, out)
        if measured_acceptance(out) is None:  # as `specray train` does: what the controller starts from
            record_acceptance(target, tokenizer, method, out)
        dirs[method] = out
    return dirs
