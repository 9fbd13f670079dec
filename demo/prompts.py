"""Deterministic held-out prompts for tests and benchmarks.

Why cut them from held-out files: acceptance rates measured on training text would be
optimistic. Why require distinct token lengths: batching, padding and per-row rollback
bugs hide when every row has the same length.

Example::

    >>> prompts = held_out_prompts(50, pair.tokenizer)  # doctest: +SKIP
    >>> len(set(prompts)) == 50                         # doctest: +SKIP
    True
"""

from __future__ import annotations

import functools
import random

from transformers import AutoTokenizer

from .corpus import corpus_documents, corpus_text

MAX_ATTEMPTS_PER_PROMPT = 200


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def held_out_prompts(
    n: int, tokenizer_dir: str, min_tokens: int = 32, max_tokens: int = 256, seed: int = 0
) -> list[str]:
    """``n`` distinct prompts cut from held-out stdlib files at line boundaries.

    Each prompt is whole lines of one file, without trailing whitespace (a lone trailing
    ``"\\n"`` would tokenize unlike the ``"\\n" + indent`` tokens seen in training). Token
    lengths lie in ``[min_tokens, max_tokens]`` and are pairwise distinct whenever
    ``n <= max_tokens - min_tokens + 1``. No prompt occurs verbatim in the training split.
    The result depends only on the arguments, the tokenizer and the Python version.
    """
    return corpus_prompts(n, tokenizer_dir, "held_out", min_tokens, max_tokens, seed)


def corpus_prompts(
    n: int, tokenizer_dir: str, split: str, min_tokens: int = 32, max_tokens: int = 256, seed: int = 0,
    distinct_lengths: bool = True,
) -> list[str]:
    """Like ``held_out_prompts`` for any split (e.g. ``"train"`` to self-distil heads on
    prompts shaped like the ones they will serve); held-out prompts also avoid training text.
    ``distinct_lengths=False`` drops the pairwise-distinct lengths requirement."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    tok = _tokenizer(tokenizer_dir)
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    files = [doc.text.splitlines(keepends=True) for doc in corpus_documents(split)]
    train_text = corpus_text("train") if split != "train" else ""
    rng = random.Random(seed)

    span = max_tokens - min_tokens + 1
    # Target lengths spread evenly over the range, visited in a shuffled order.
    targets = [min_tokens + (i * span) // max(n, 1) for i in range(n)]
    rng.shuffle(targets)
    unique_lengths = distinct_lengths and n <= span
    prompts: list[str] = []
    seen_prompts: set[str] = set()
    seen_lengths: set[int] = set()
    for want in targets:
        for _ in range(MAX_ATTEMPTS_PER_PROMPT):
            lines = files[rng.randrange(len(files))]
            start = rng.randrange(len(lines))
            text = _cut(lines, start, want, count)
            if text is None or text in seen_prompts or (train_text and text in train_text):
                continue
            length = count(text)
            if length < min_tokens or (unique_lengths and length in seen_lengths):
                continue
            prompts.append(text)
            seen_prompts.add(text)
            seen_lengths.add(length)
            break
        else:
            raise RuntimeError(f"could not cut a {want}-token prompt from the {split} files")
    return prompts


def _cut(lines: list[str], start: int, want: int, count) -> str | None:
    """Longest run of whole lines from ``start`` whose text has at most ``want`` tokens."""
    if not lines[start].strip():
        return None  # start on a line with content
    best = None
    text = ""
    for line in lines[start:]:
        text += line
        candidate = text.rstrip()
        if count(candidate) > want:
            break
        best = candidate
    return best
