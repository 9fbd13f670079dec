"""Benchmarks (``specray bench NAME``). Results go to ``DEFAULT_OUT`` in the current directory,
never into the installed package (with ``pip install -e .`` that is the source checkout)."""

DEFAULT_OUT = "specray-bench"


def demo_options(parser, max_tokens: int) -> None:
    """The options of a benchmark that runs batches of held-out prompts on the demo pair."""
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch size")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")


def announce(name: str, argv) -> str:
    """One torch thread (small models on shared cores); prints and returns the command run."""
    import sys

    import torch

    torch.set_num_threads(1)
    command = f"python -m specray.bench.{name} " + " ".join(argv if argv is not None else sys.argv[1:])
    print("command:", command)
    return command
