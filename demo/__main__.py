"""``python -m specray.demo [--seed N] [--force] [--cache-dir DIR]``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
