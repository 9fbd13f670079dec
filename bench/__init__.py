"""Benchmarks (``specray bench NAME``). Results go to ``DEFAULT_OUT`` in the current directory,
never into the installed package (with ``pip install -e .`` that is the source checkout)."""

DEFAULT_OUT = "specray-bench"
