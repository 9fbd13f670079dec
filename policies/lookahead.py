"""Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding"; TensorRT-LLM's ``LookaheadDecodingConfig(W, N, G)``).

The target guesses for itself; no draft model, no training. Each step one target forward
runs two branches beside the row's root (the last committed token, offset 0):

* **the lookahead branch** — a 2-D window of Jacobi iterates, never accepted, never kept:
  ``N - 1`` levels x ``W`` columns. Level 0 is a guessed continuation of the root: column
  c (c >= 1) sits at offset c, column 0 *is* the root. Level l >= 1, column j sits at
  offset j + l and attends to the committed prefix, level 0's columns 0..j and column j of
  levels 1..l (the lookahead-decoding mask)::

      level 2:        .  b2 c2 d2          offsets 2..5
      level 1:     .  b1 c1 d1             offsets 1..4     (W = 4, N = 4)
      level 0:  r  b0 c0 d0                offsets 0..3     r = the root

  The target's argmax at the last level (at level 0: the token it emitted after the root)
  is one Jacobi iteration: column j's diagonal ``(level0[j], level1[j], .., out[j])`` is an
  N-gram whose every token was the target's guess given the ones before it. The W N-grams
  go into the pool; then the window moves one position on (level l + 1 becomes level l,
  the outputs the new last level), as in the reference implementation (which moves by one
  whatever was accepted). The first N - 2 steps only fill the levels (the window starts
  N - 2 columns wider and loses one per filling step).
* **the verification branch** — up to G pooled N-grams keyed by the root (``pool[root]``:
  continuations whose first token follows the last committed token), packed into a
  prefix-shared token tree below the root (the ``DraftRow``'s tree); each candidate sees the
  prefix, the root and its own earlier tokens only.

Acceptance is the tree rule (``kernels/tree_acceptance.py``): greedy keeps the longest
candidate prefix matching the target's argmax, plus the target's next token. Candidates
are deterministic proposals (one-hot q): sampled rows are verified by recursive rejection
over siblings, which keeps the target's distribution exactly whatever the pool holds. The
window keeps running under sampling (its outputs are the target's argmax, the root
column's the token actually emitted); it only decides which N-grams are *proposed*, never
what is emitted, so every (W, N, G), pool and window state gives the target's output.

The pool (``NgramPool``): per key token, at most G continuations (least recently added
first out). Like TensorRT-LLM (``fillWithPrompt``) it is also fed the N-grams of the
committed tokens (the prompt first, then the output as it grows), so text that repeats is
found without waiting for the window. A request's pool is its own and freed when it
finishes; with ``shared_pool`` it uses the pool shared by the engine's requests of the
same N, which is bounded (``shared_pool_ngrams``; least recently used keys evicted).

Room: a row verifies at most ``row.width`` new nodes (its KV room) and accepts at most
``row.num_tokens``; candidates are cut first to that depth, then the window loses columns
(near the end of the context or of max_tokens a request gets a smaller window, never an
error). Every verified token costs compute where the target is compute-bound (on CPU, and
on any device at large batches), so when several lookahead rows share a step they share
fixed budgets of window tokens and of candidate tokens (``batch_window_tokens``,
``batch_candidate_tokens``): the window narrows, then stops, and fewer candidates are
verified as the batch grows; one row alone always gets its whole (W, N, G).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, Mapping, Sequence

import torch
from pydantic import Field, model_validator

from specray.kernels.tree import TokenTree
from specray.policies.base import CommitRow, Draft, DraftRow, ExtraNodes, ProposalRow, extends
from specray.policies.registry import Limits, MethodOptions, MethodSpec, register_method

# The engine-wide bound of a shared pool, in N-grams (least recently used keys go first).
SHARED_POOL_NGRAMS = 1 << 16
# Window tokens, and candidate tokens, per step summed over the step's lookahead rows before
# each row's window or candidate tree is cut (an even share each, at least one token); a row
# alone in its step always gets its whole (W, N, G).
BATCH_WINDOW_TOKENS = 16
BATCH_CANDIDATE_TOKENS = 64


class LookaheadOptions(MethodOptions):
    """Lookahead decoding: a Jacobi window of W columns x (N - 1) levels, up to G candidates.

    The defaults (3, 5, 2) were among the fastest measured on the demo pair on CPU at batch
    1 and 8 (``python -m specray.bench.lookahead``), where every verified token costs
    compute. The paper and TensorRT-LLM's example use wider settings on GPUs (7, 5, 7 in
    TensorRT-LLM's); those were not measured here.

    (W, N, G) always count as given, defaults included: lookahead sizes itself (it narrows
    its window and candidates as batches grow), so the verification budget
    (``policies/budget.py``) leaves its requests as they are: it would otherwise price a
    request off in its first steps, while the window fills the pool and nothing is drafted.
    """

    method: Literal["lookahead"] = "lookahead"
    window_size: int = Field(3, ge=2, le=64, description="W: Jacobi window columns (N-grams harvested per step).")
    ngram_size: int = Field(5, ge=2, le=16, description="N: n-gram size; the window has N - 1 levels and "
                            "candidates are N - 1 tokens long.")
    verification_set_size: int = Field(2, ge=1, le=64, description="G: most candidate n-grams verified per step "
                                       "(and kept per key in the pool).")
    shared_pool: bool = Field(False, description="Use the engine's n-gram pool shared with other requests "
                              "(bounded, LRU) instead of a pool of this request's own.")

    @model_validator(mode="before")
    @classmethod
    def _sizes_given(cls, data):
        if isinstance(data, dict):
            data = {**{f: cls.model_fields[f].default for f in _SIZES}, **data}
        return data

    @property
    def tokens_per_step(self) -> int:
        """New tokens a full step verifies: W x (N - 1) + G x (N - 1) (the root's included)."""
        return (self.window_size + self.verification_set_size) * (self.ngram_size - 1)


_SIZES = ("window_size", "ngram_size", "verification_set_size")


class NgramPool:
    """N-grams by first token: ``key -> continuations`` (the N - 1 tokens after it).

    Each key keeps at most ``per_key`` continuations (re-adding one refreshes it; the least
    recently added goes first). ``max_ngrams`` bounds the whole pool: the least recently
    used keys (added to or guessed from) are evicted.

    >>> pool = NgramPool()
    >>> for key, cont in [(1, (2, 3)), (1, (4, 5)), (1, (2, 3)), (1, (6, 7))]:
    ...     pool.add(key, cont, per_key=2)
    >>> pool.guess(1, 4)  # most recent first; (4, 5) was the oldest of three
    [(6, 7), (2, 3)]
    """

    def __init__(self, max_ngrams: int | None = None):
        self.max_ngrams = max_ngrams
        self._map: OrderedDict[int, OrderedDict[tuple[int, ...], None]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def ngrams(self) -> list[tuple[int, tuple[int, ...]]]:
        """Every (first token, continuation) pooled, least recently used key first."""
        return [(key, cont) for key, conts in self._map.items() for cont in conts]

    def add(self, key: int, cont: tuple[int, ...], per_key: int) -> None:
        entries = self._map.get(key)
        if entries is None:
            entries = self._map[key] = OrderedDict()
        else:
            self._map.move_to_end(key)
        if cont in entries:
            entries.move_to_end(cont)
        else:
            entries[cont] = None
            self._size += 1
        while len(entries) > per_key:
            entries.popitem(last=False)
            self._size -= 1
        while self.max_ngrams is not None and self._size > self.max_ngrams and len(self._map) > 1:
            _, evicted = self._map.popitem(last=False)
            self._size -= len(evicted)

    def add_sequence(self, tokens: Sequence[int], n: int, start: int, per_key: int) -> None:
        """The N-grams of ``tokens`` whose last token is at index >= ``start``, oldest first."""
        for end in range(max(start, n - 1), len(tokens)):
            self.add(tokens[end - n + 1], tuple(tokens[end - n + 2 : end + 1]), per_key)

    def guess(self, key: int, g: int) -> list[tuple[int, ...]]:
        """Up to ``g`` continuations of ``key``, most recent first."""
        entries = self._map.get(key)
        if not entries:
            return []
        self._map.move_to_end(key)
        out = []
        for cont in reversed(entries):
            if len(out) == g:
                break
            out.append(cont)
        return out


class JacobiWindow:
    """The lookahead branch of one row (see the module doc for the picture).

    levels[0]: level 0 without the root (columns 1 .. C-1, offsets 1 .. C-1);
    levels[l]: level l's C columns (offsets l .. C-1+l), for the l levels filled so far.
    C = W while full; while filling it is wider by the levels still missing.
    """

    def __init__(self, width: int, ngram: int, start: Sequence[int]):
        if len(start) != width + ngram - 3:
            raise ValueError(f"a window of W={width}, N={ngram} starts with {width + ngram - 3} tokens, "
                             f"got {len(start)}")
        self.width, self.ngram = width, ngram
        self.levels: list[list[int]] = [list(start)]

    @property
    def columns(self) -> int:
        return len(self.levels[0]) + 1

    @property
    def full(self) -> bool:
        return len(self.levels) == self.ngram - 1

    def size(self, cols: int) -> int:
        """Window tokens fed to the target when ``cols`` columns run (the root not counted)."""
        return cols - 1 + (len(self.levels) - 1) * cols

    def columns_within(self, room: int) -> int:
        """Most columns whose tokens fit ``room`` (0 when not even column 0 does)."""
        upper = len(self.levels) - 1
        if room < upper:
            return 0
        return min(self.columns, (room + 1) // (upper + 1))

    def nodes(self, cols: int, tree_size: int) -> ExtraNodes:
        """The first ``cols`` columns as extra nodes after a tree of ``tree_size`` nodes."""
        tokens = self.levels[0][: cols - 1] + [t for level in self.levels[1:] for t in level[:cols]]
        upper = len(self.levels) - 1
        positions = list(range(1, cols)) + [j + l for l in range(1, upper + 1) for j in range(cols)]
        m = len(tokens)
        sees = torch.zeros(m, tree_size + m, dtype=torch.bool)
        sees[:, 0] = True  # the root (level 0, column 0)
        sees[:, tree_size:] = _window_mask(cols, upper)
        return ExtraNodes(tokens, positions, sees)

    def outputs(self, cols: int, root_next: int, best: Sequence[int]) -> list[int]:
        """The last level's next tokens at the ``cols`` columns run: ``best`` is the target's
        argmax at each window token (``nodes`` order), ``root_next`` its token after the root."""
        upper = len(self.levels) - 1
        if upper == 0:
            return [root_next] + list(best[: cols - 1])
        start = cols - 1 + (upper - 1) * cols
        return list(best[start : start + cols])

    def advance(self, root: int, out: Sequence[int]) -> list[tuple[int, tuple[int, ...]]]:
        """One Jacobi iteration from the last level's next tokens ``out`` (for the first
        len(out) columns; the others keep their last level). Returns the harvested
        N-grams as (first token, continuation), one per column run (none while filling)."""
        levels, cols = self.levels, len(out)
        last = ([root] + levels[0]) if len(levels) == 1 else levels[-1]
        out = list(out) + last[cols:]
        harvest = []
        if self.full:
            first = [root] + levels[0]
            harvest = [(first[j], tuple(level[j] for level in levels[1:]) + (out[j],)) for j in range(cols)]
            stack = levels[1:] + [out]  # level l + 1 becomes level l; level 0 loses its root column
            self.levels = [stack[0][1:]] + stack[1:]
        else:  # filling: a new level, and every level moves one position on
            self.levels = [level[1:] for level in levels] + [out[1:]]
        return harvest


@lru_cache(maxsize=256)
def _window_mask(cols: int, upper: int) -> torch.Tensor:
    """[m, m] bool: which window tokens each window token sees (the root aside)."""
    m = cols - 1 + upper * cols
    mask = torch.zeros(m, m, dtype=torch.bool)

    def index(level: int, col: int) -> int:  # level 0: columns 1..cols-1
        return col - 1 if level == 0 else cols - 1 + (level - 1) * cols + col

    for level in range(upper + 1):
        for col in range(1 if level == 0 else 0, cols):
            row = index(level, col)
            mask[row, [index(0, c) for c in range(1, col + 1)]] = True  # level 0 up to this column
            mask[row, [index(lv, col) for lv in range(1, level + 1)]] = True  # this column's history
    return mask


def pack_candidates(candidates: Sequence[Sequence[int]], depth: int, budget: int) -> tuple[list[int], list[int]]:
    """Candidates as one prefix-shared tree below the root: (node tokens, parents), at most
    ``depth`` deep and ``budget`` nodes; node i + 1 hangs under ``parents[i]`` (0 = root).

    >>> pack_candidates([(5, 6, 7), (5, 8, 9), (4, 6, 7)], depth=2, budget=8)
    ([5, 6, 8, 4, 6], [0, 1, 1, 0, 4])
    """
    tokens: list[int] = []
    parents: list[int] = []
    children: list[dict[int, int]] = [{}]
    for cand in candidates:
        node = 0
        for tok in cand[:depth]:
            nxt = children[node].get(tok)
            if nxt is None:
                if len(tokens) >= budget:
                    break
                tokens.append(tok)
                parents.append(node)
                children.append({})
                nxt = children[node][tok] = len(tokens)
            node = nxt
    return tokens, parents


@dataclass
class _Row:
    """One request's lookahead state: its options, window, pool and committed tokens seen."""

    options: LookaheadOptions
    window: JacobiWindow
    pool: NgramPool
    tokens: list[int]
    sent: tuple[int, int] | None = None  # (root, window columns) of the step in flight


class LookaheadProposer:
    """Per-row Jacobi windows and n-gram pools (see the module doc).

    history: also pool the committed tokens' N-grams (prompt and output).
    window: run the Jacobi window (False, an ablation: the verification branch alone, the
        pool holding only the committed tokens' N-grams).
    shared_pool_ngrams: bound of each shared pool (one per N).
    batch_window_tokens, batch_candidate_tokens: window / candidate tokens per step over all
        rows (two or more) before each row's share is cut.

    >>> from specray.policies.base import ProposalRow
    >>> prop = LookaheadProposer()
    >>> opts = LookaheadOptions(window_size=2, ngram_size=3, verification_set_size=2)
    >>> row = prop.propose([ProposalRow(slot=0, token_ids=[5, 6, 7, 5], num_tokens=4, options=opts)]).rows[0]
    >>> row.tokens, row.tree.parents.tolist()     # pool[5] holds (6, 7), from the prompt
    ([6, 7], [-1, 0, 1])
    >>> len(row.extra.tokens)                     # level 0 while filling: W + N - 3 tokens
    2
    """

    def __init__(self, history: bool = True, window: bool = True, shared_pool_ngrams: int = SHARED_POOL_NGRAMS,
                 batch_window_tokens: int = BATCH_WINDOW_TOKENS, batch_candidate_tokens: int = BATCH_CANDIDATE_TOKENS,
                 **_ignored: object):
        self.history, self.run_window = history, window
        self.shared_pool_ngrams = shared_pool_ngrams
        self.batch_window_tokens, self.batch_candidate_tokens = batch_window_tokens, batch_candidate_tokens
        self._rows: dict[int, _Row] = {}
        self.shared: dict[int, NgramPool] = {}  # ngram_size -> the pool requests share

    def pool(self, slot: int) -> NgramPool | None:
        row = self._rows.get(slot)
        return row.pool if row is not None else None

    def window(self, slot: int) -> JacobiWindow | None:
        row = self._rows.get(slot)
        return row.window if row is not None else None

    # -- propose ---------------------------------------------------------------------------
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        shares = None  # one row: its whole window and candidates
        if len(rows) > 1:
            shares = (max(1, self.batch_candidate_tokens // len(rows)), max(1, self.batch_window_tokens // len(rows)))
        return Draft([self._propose_row(r, shares) for r in rows])

    def _propose_row(self, r: ProposalRow, shares: tuple[int, int] | None) -> DraftRow:
        if r.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {r.num_tokens} for slot {r.slot}")
        state = self._sync(r)
        o, root = state.options, int(r.token_ids[-1])
        width = r.width if r.width is not None else o.tokens_per_step + o.ngram_size  # None: no KV limit
        candidates = state.pool.guess(root, o.verification_set_size)
        budget = width if shares is None else min(width, shares[0])
        tokens, parents = pack_candidates(candidates, min(o.ngram_size - 1, r.num_tokens), budget)
        room = width - len(tokens)
        if shares is not None:
            room = min(room, shares[1])
        cols = state.window.columns_within(room) if self.run_window else 0
        extra = state.window.nodes(cols, len(tokens) + 1) if cols > 0 else None
        if extra is not None and not extra.tokens:
            extra = None
        state.sent = (root, cols)
        # A single line of candidates is a chain: the batched token-match path takes it.
        tree = None if parents == list(range(len(parents))) else TokenTree.from_parents(parents)
        return DraftRow(tokens, tree, None, extra)

    def _sync(self, r: ProposalRow) -> _Row:
        """The row's state, created on its first step (or for a new request in the slot),
        with the committed tokens added since the last step pooled."""
        o = r.options if isinstance(r.options, LookaheadOptions) else LookaheadOptions()
        state = self._rows.get(r.slot)
        seen = len(state.tokens) if state is not None else 0
        if state is None or state.options != o or not extends(r.token_ids, state.tokens):
            state = self._rows[r.slot] = self._new_row(r.token_ids, o)
            seen = 0
        state.tokens.extend(r.token_ids[seen:])
        if self.history:
            state.pool.add_sequence(state.tokens, o.ngram_size, max(seen, 1), o.verification_set_size)
        return state

    def _new_row(self, token_ids: Sequence[int], o: LookaheadOptions) -> _Row:
        if o.shared_pool:
            pool = self.shared.setdefault(o.ngram_size, NgramPool(self.shared_pool_ngrams))
        else:
            pool = NgramPool()
        # The window starts from committed tokens drawn at random (as the reference does),
        # seeded by the sequence so every layout proposes the same.
        rng = random.Random(len(token_ids) * 1_000_003 + int(token_ids[-1]))
        start = [int(rng.choice(token_ids)) for _ in range(o.window_size + o.ngram_size - 3)]
        return _Row(o, JacobiWindow(o.window_size, o.ngram_size, start), pool, [])

    # -- commit / release ------------------------------------------------------------------
    def commit(self, rows: Sequence[CommitRow]) -> None:
        """One Jacobi iteration per row that ran its window: harvest, then move on."""
        for c in rows:
            state = self._rows.get(c.slot)
            if state is None or state.sent is None:
                continue
            (root, cols), state.sent = state.sent, None
            window = state.window
            best = c.extra_best or []
            if cols == 0 or len(best) != window.size(cols):
                continue  # the window did not run (the worker was down, or no room)
            out = window.outputs(cols, c.tokens[0], best)
            for key, cont in window.advance(root, out):
                state.pool.add(key, cont, state.options.verification_set_size)

    def release(self, slot: int) -> None:
        self._rows.pop(slot, None)  # a private pool goes with it; a shared one stays (bounded)


def _check(options: LookaheadOptions, facts: Mapping, limits: Limits) -> None:
    need = options.tokens_per_step
    if need >= limits.capacity:
        raise ValueError(
            f"lookahead window_size x (ngram_size - 1) + verification_set_size x (ngram_size - 1) = {need} "
            f"new tokens per step does not fit the {limits.capacity}-token context: lower window_size, "
            "ngram_size or verification_set_size")


register_method(MethodSpec(
    name="lookahead",
    options=LookaheadOptions,
    build=lambda ctx: LookaheadProposer(),
    drafts_trees=True,
    placement="worker",
    requirement="nothing (always available)",
    check=_check,
))
