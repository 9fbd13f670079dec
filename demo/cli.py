"""``python -m specray.demo``: build (or load) the demo pair and print it as JSON.

``--ship`` (maintainers) copies the pair into the package, as ``demo/weights/``.
``specray demo-models`` calls the same :func:`main`-equivalent, so both print one line
``{"target": ..., "draft": ..., "tokenizer": ..., "alpha": ..., "cost_ratio": ...}`` on
stdout; progress and the alpha / c report go to stderr through logging.

Example::

    $ python -m specray.demo --seed 0
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import shutil

from .pair import SHIPPED_DIR, load_or_build_demo_pair


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, load or build the pair, print its JSON; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m specray.demo",
        description="Build (first time, a few CPU minutes) or load the cached demo "
        "draft/target pair and print its paths and quality as JSON.",
    )
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--cache-dir", default=None,
                        help="cache folder (default: $SPECRAY_CACHE or ~/.cache/specray)")
    parser.add_argument("--quiet", action="store_true", help="only warnings on stderr")
    parser.add_argument("--ship", action="store_true",
                        help="copy the pair into the package (demo/weights/), where a first run unpacks it "
                             "instead of training; with --force, after building it here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s")
    pair = load_or_build_demo_pair(cache_dir=args.cache_dir, seed=args.seed, force=args.force)
    if args.ship:
        ship(pathlib.Path(pair.target).parent)
    print(pair.to_json())  # CLI output: the one line callers parse
    return 0


def ship(pair_dir: pathlib.Path) -> None:
    """Replace the package's shipped pair with the one in ``pair_dir``."""
    shutil.rmtree(SHIPPED_DIR, ignore_errors=True)
    shutil.copytree(pair_dir, SHIPPED_DIR)
    logging.getLogger(__name__).info("shipped %s as %s", pair_dir, SHIPPED_DIR)
