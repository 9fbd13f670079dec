"""The demo model pair: a small target and draft ``LlamaForCausalLM`` plus tokenizer,
trained in a few CPU minutes on the Python standard library's source and cached.

No machine here can download weights, so specray builds its own real pair; ``specray
serve`` with no model arguments, the tests and the CPU benchmarks use it.

Example::

    >>> from specray.demo import load_or_build_demo_pair, held_out_prompts
    >>> pair = load_or_build_demo_pair()          # doctest: +SKIP
    >>> prompts = held_out_prompts(50, pair.tokenizer)  # doctest: +SKIP
    >>> print(pair.to_json())                     # doctest: +SKIP
"""

from .cli import main
from .corpus import CorpusFile, corpus_documents, corpus_text
from .metrics import MeasureConfig
from .pair import DemoPair, default_cache_dir, load_or_build_demo_pair
from .prompts import corpus_prompts, held_out_prompts
from .training import DemoRecipe

__all__ = [
    "CorpusFile",
    "DemoPair",
    "DemoRecipe",
    "MeasureConfig",
    "corpus_documents",
    "corpus_prompts",
    "corpus_text",
    "default_cache_dir",
    "held_out_prompts",
    "load_or_build_demo_pair",
    "main",
]
