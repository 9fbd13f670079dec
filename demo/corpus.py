"""The demo corpus: the Python standard library's own ``.py`` source.

Why this text: every machine that runs specray has it, offline, so the demo pair can be
trained anywhere without downloads. The flip side is that the corpus (and therefore the
trained weights) depends on the Python version, which is why the cache key carries it.

The split into train / held-out is by a hash of each file's path relative to the stdlib
root, not by a random draw: a file lands on the same side on every machine and every run,
and adding or removing other files never moves it. Held-out files feed the acceptance
measurement and :func:`specray.demo.held_out_prompts`, so benchmarks never prompt the
models with text they were trained on.

Example::

    >>> from specray.demo.corpus import corpus_documents
    >>> docs = corpus_documents("held_out")
    >>> all(d.split == "held_out" for d in docs)
    True
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import sysconfig

SPLITS = ("train", "held_out")

HELD_OUT_PERCENT = 5
"""Share of files (by path hash) kept out of tokenizer and model training."""

EXCLUDED_DIR_NAMES = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
"""Folder names whose contents are not part of the corpus: installed third-party code is
machine-specific, and CPython's test suites are huge, repetitive and full of deliberately
odd code. ``idlelib/idle_test`` and ``lib2to3/tests`` are covered by these names."""

EOS_TEXT = "<|endoftext|>"
"""Separator between documents in :func:`corpus_text`; the demo tokenizer maps it to its
end-of-text token."""


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    """One stdlib source file. ``relpath`` is POSIX-style, relative to the stdlib root."""

    relpath: str
    split: str
    text: str


def stdlib_root() -> pathlib.Path:
    """Folder of the running interpreter's standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """Deterministic split of a file from its relative path (stable across machines)."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    return "held_out" if bucket < HELD_OUT_PERCENT else "train"


def is_excluded(relpath: str) -> bool:
    """True for files inside third-party or test folders."""
    folders = relpath.split("/")[:-1]
    return any(part in EXCLUDED_DIR_NAMES or part.startswith("test_") for part in folders)


def list_corpus_paths(root: pathlib.Path | None = None) -> list[str]:
    """Sorted relative paths of all corpus files (both splits)."""
    root = stdlib_root() if root is None else root
    paths = []
    for folder, subdirs, files in os.walk(root):
        # Prune in place: site-packages alone holds far more files than the stdlib.
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIR_NAMES
                      and not d.startswith("test_") and d != "__pycache__"]
        rel = pathlib.Path(folder).relative_to(root)
        paths += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(p for p in paths if not is_excluded(p))


@functools.lru_cache(maxsize=4)
def _load(split: str, root: str | None) -> tuple[CorpusFile, ...]:
    base = stdlib_root() if root is None else pathlib.Path(root)
    docs = []
    for rel in list_corpus_paths(base):
        if split_of(rel) != split:
            continue
        # A few stdlib files are not valid UTF-8; "replace" keeps them deterministic.
        text = (base / rel).read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            docs.append(CorpusFile(rel, split, text))
    return tuple(docs)


def corpus_documents(split: str, root: str | None = None) -> list[CorpusFile]:
    """Files of one split (``"train"`` or ``"held_out"``), sorted by path."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return list(_load(split, root))


def corpus_text(split: str, root: str | None = None) -> str:
    """All files of a split joined by ``<|endoftext|>`` (e.g. to self-distil heads over
    the demo corpus: encoding this with the demo tokenizer yields its eos id between files)."""
    return EOS_TEXT.join(doc.text for doc in corpus_documents(split, root))
