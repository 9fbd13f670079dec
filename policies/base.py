"""The typed boundaries between proposing, verifying and committing, and the proposer interface.

One step, per row of the batch (the *root* is the row's last committed token, sampled but
not yet in the target's KV cache):

    ProposalRow  -> Proposer.propose -> DraftRow     what to verify: nodes 1..n below the root
    DraftRow     -> runner verifies root + nodes (+ extra nodes) in one forward
    acceptance   -> CommitRow -> Proposer.commit      what was kept, and the target's features

A ``DraftRow`` is a *token tree*: each node has a parent (node 0 is the root), so a chain
(draft model, prompt lookup) is the special case ``parents = 0, 1, 2, ...``, Medusa/EAGLE-1
a static tree, EAGLE-2/ReDrafter a tree built per row and step. Optional per-node draft
probabilities make tree rejection sampling exact for sampled nodes. ``extra`` nodes
(a lookahead window) are verified in the same forward but are never accepted and never
kept in the cache.

A ``CommitRow`` tells the proposer, per row, the emitted tokens, the accepted path (node
indices, root first) and — for methods that declare ``needs_features`` — the target's
hidden states at the root and each accepted node, the positions whose outputs produced the
emitted tokens: the final norm's, or the layers the method's ``feature_layers`` names,
concatenated. Prefill hands the same features for the prompt (``PrefillRow``). Rollback
stays an integer per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, Sequence

import torch

from specray.kernels.tree import TokenTree, chain_tree


@dataclass(frozen=True)
class SamplingView:
    """What a proposer needs of a row's sampling parameters (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ProposalRow:
    """One row to draft for.

    token_ids:  all committed tokens (prompt + output so far); the last is the root.
    num_tokens: most draft nodes that can be accepted this step (max_tokens, the context,
                the request's k and the speculation-length cap all applied).
    width:      most new nodes the row may feed the target (KV room), extra nodes included.
    options:    the request's typed method options (``MethodOptions`` of its method).
    seed:       the request's seed, for proposers in other processes (they keep their own
                generators; the request's own generator never leaves the engine).
    """

    slot: int
    token_ids: Sequence[int]
    num_tokens: int
    sampling: SamplingView = SamplingView()
    generator: torch.Generator | None = None
    options: object = None
    width: int | None = None
    seed: int | None = None

    def option(self, name: str, default=None):
        return getattr(self.options, name, default) if self.options is not None else default


@dataclass(frozen=True)
class ExtraNodes:
    """Nodes verified beside the tree but never accepted nor kept (a lookahead window).

    tokens:    [m] token ids
    positions: [m] position offsets from the root (root = 0)
    sees:      [m, 1 + n + m] bool: extra node j attends to root/tree node i (column i) or
               to extra node k (column 1 + n + k); the committed prefix is always visible.
    """

    tokens: list[int]
    positions: list[int]
    sees: torch.Tensor


@dataclass(frozen=True)
class DraftRow:
    """One row's draft: nodes 1..n below the root.

    tokens: [n] node tokens (node i + 1 is tokens[i])
    tree:   the node structure (``TokenTree``, root = node 0); None = a chain
    probs:  [n, V] the distribution each node was sampled from, or None for deterministic
            proposals (one-hot q, still exact for rejection sampling)
    extra:  nodes verified alongside but never accepted (None for most methods)
    confidence: [n] the drafter's own estimate, per node of a chain, of the probability that
            node j is accepted given that node j - 1 was (node 1: given the root); computed
            before node j's token was drawn, from what precedes it, so a verification budget
            may cut the chain by it and stay exact (DSpark's confidence head); None: no estimate
    """

    tokens: list[int]
    tree: TokenTree | None = None
    probs: torch.Tensor | None = None
    extra: ExtraNodes | None = None
    confidence: tuple[float, ...] | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.tree is None

    @cached_property
    def structure(self) -> TokenTree:
        """The tree, a chain's included (for code that walks any row the same way)."""
        return self.tree if self.tree is not None else chain_tree(len(self.tokens))

    def filled(self, tokens: list[int], tree: TokenTree | None = None) -> "DraftRow":
        """This draft with ``tokens`` (and ``tree`` where given) read back from the device:
        ``dataclasses.replace`` without its field lookups (a device step builds one per row
        drafted there), every other field kept."""
        return DraftRow(tokens, self.tree if tree is None else tree, self.probs, self.extra, self.confidence)

    def cut(self, n: int) -> "DraftRow":
        """A chain's first ``n`` nodes (trees are cut by their proposer, which knows its order)."""
        if self.tree is not None or n >= len(self.tokens):
            return self
        return DraftRow(self.tokens[:n], None, self.probs[:n] if self.probs is not None else None, self.extra,
                        self.confidence[:n] if self.confidence is not None else None)


EMPTY = DraftRow([])


class Draft:
    """A batch of ``DraftRow``s, with the padded tensor view code and tests read.

    tokens:  [B, K] int64, right-padded with 0 past ``lengths``
    lengths: [B] int64 nodes per row (0 = no proposal)
    probs:   [B, K, V] float32 or None (None when no row carries probabilities)
    """

    def __init__(self, rows: Sequence[DraftRow]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    @staticmethod
    def from_lists(token_lists: Sequence[Sequence[int]], probs: torch.Tensor | None = None) -> "Draft":
        """Chains from ragged token lists; ``probs`` [B, K, V] (row i's first len_i used)."""
        rows = []
        for i, t in enumerate(token_lists):
            p = probs[i, : len(t)] if probs is not None and len(t) else None
            rows.append(DraftRow([int(x) for x in t], None, p))
        return Draft(rows)

    @staticmethod
    def empty(batch: int) -> "Draft":
        return Draft([EMPTY] * batch)

    @property
    def max_len(self) -> int:
        return max((r.size for r in self.rows), default=0)

    @cached_property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([r.size for r in self.rows], dtype=torch.long)

    @cached_property
    def tokens(self) -> torch.Tensor:
        out = torch.zeros(len(self.rows), self.max_len, dtype=torch.long)
        for i, r in enumerate(self.rows):
            if r.size:
                out[i, : r.size] = torch.tensor(r.tokens, dtype=torch.long)
        return out

    @cached_property
    def probs(self) -> torch.Tensor | None:
        with_probs = [(i, r.probs) for i, r in enumerate(self.rows) if r.probs is not None and r.size]
        if not with_probs:
            return None
        vocab = with_probs[0][1].shape[-1]
        out = torch.zeros(len(self.rows), self.max_len, vocab)
        for i, p in with_probs:
            out[i, : p.shape[0]] = p.to(out.device, out.dtype)
        return out


@dataclass(frozen=True)
class DeviceTrees:
    """Trees built on the device for some rows of a ``DeviceDraft`` (EAGLE-2, ReDrafter):
    their structure, like their tokens, stays there until the step's one read-back.

    rows:         [m] the part's row indices (their ``DraftRow`` holds a placeholder tree
                  of the right size, ``placeholder_tree``)
    parents:      [m, T] int64 device, node i + 1 hangs under node parents[j, i] (0 = root;
                  rows with fewer nodes are right-padded)
    max_depth:    an upper bound of the trees' depth
    max_children: an upper bound of any node's children
    """

    rows: list[int]
    parents: torch.Tensor
    max_depth: int
    max_children: int


def placeholder_tree(size: int) -> TokenTree:
    """The host's stand-in for a tree of ``size`` nodes built on the device: every node
    under the root (the device writes the real structure into the verification)."""
    return TokenTree.from_parents([0] * size)


class DeviceDraft(Draft):
    """Drafts made on the device whose tokens stay there until the step's one read-back
    (``engine/device_step.py``). ``rows`` hold placeholder tokens and each row's tree (None
    for chains); device_tokens: [n, k] int64, row i's nodes 1..rows[i].size (right-padded);
    device_probs: [n, k, V] float32 the distribution each node was drawn from, or None for
    deterministic proposals; with_probs: [n] which rows' nodes carry those (None: every
    sampled row, when device_probs is given); trees: rows whose tree structure was built on
    the device."""

    def __init__(self, rows: Sequence[DraftRow], device_tokens: torch.Tensor, device_probs: torch.Tensor | None,
                 with_probs: Sequence[bool] | None = None, trees: Sequence[DeviceTrees] = ()):
        super().__init__(rows)
        self.device_tokens, self.device_probs = device_tokens, device_probs
        self.with_probs = None if with_probs is None else list(with_probs)
        self.trees = list(trees)

    def carries_probs(self, n: int) -> bool:
        """Whether row n's nodes carry the distribution they were drawn from."""
        if self.device_probs is None:
            return False
        return True if self.with_probs is None else self.with_probs[n]


@dataclass(frozen=True)
class CommitRow:
    """What one row kept this step.

    tokens:   emitted tokens: the accepted nodes' tokens, then the recovered/bonus token
              (the new root, not yet in the target's cache)
    path:     kept node indices, root first (a chain: 0 .. num_accepted)
    features: [len(path), F] the target's hidden states at the path's nodes (the outputs
              that produced ``tokens``) for methods that need features, else None: the final
              norm's (F = H), or the method's ``feature_layers`` concatenated (F = n x H)
    extra_best: the target's argmax at each extra node (lookahead windows), else None
    """

    slot: int
    tokens: list[int]
    path: list[int]
    features: torch.Tensor | None = None
    extra_best: list[int] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1

    def with_features(self, features: torch.Tensor) -> "CommitRow":
        """This row carrying ``features``, every other field kept. The executor builds one per
        row of a feature method per step, drafting or not, so the copy skips the frozen
        dataclass's ``__init__`` (one ``object.__setattr__`` per field): the same fields,
        copied as a dict."""
        row = object.__new__(CommitRow)
        row.__dict__.update(self.__dict__)
        row.__dict__["features"] = features
        return row


@dataclass(frozen=True)
class PrefillRow:
    """A request entered the batch: its prompt went through the target.

    features: [len(token_ids) - start, F] the target's hidden states at the prompt tokens it
              computed (methods that need features; as ``CommitRow.features``), else None;
              ``first_token`` is the new root.
    start:    the target started from a cached prefix of this many tokens (paged KV, prefix
              caching): features begin there, and the engine attached the proposer's own
              cache (``runner``) to its cached blocks of the same prefix.
    """

    slot: int
    token_ids: Sequence[int]
    first_token: int
    features: torch.Tensor | None = None
    start: int = 0


def extends(token_ids: Sequence[int], seen: Sequence[int]) -> bool:
    """Whether ``token_ids`` is ``seen`` grown, for proposers that keep state per slot: a new
    request in a reused slot is not. Reads three positions (start, middle, last seen), not
    the whole sequence.

    >>> extends([1, 2, 3, 4], [1, 2, 3]), extends([1, 2], [1, 2, 3]), extends([7, 2, 3, 4], [1, 2, 3])
    (True, False, False)
    """
    n = len(seen)
    if len(token_ids) < n:
        return False
    return n == 0 or all(token_ids[i] == seen[i] for i in (0, (n - 1) // 2, n - 1))


class Proposer(Protocol):
    """The smallest drafting interface (cf. HF ``CandidateGenerator``).

    Slots are the engine's row ids: a request keeps its slot from admission to finish.
    ``prefill`` is optional (proposers that need the prompt's features define it).
    """

    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        """Draft at most ``row.num_tokens`` acceptable nodes for each row."""

    def commit(self, rows: Sequence[CommitRow]) -> None:
        """After verification: what each row kept (roll back to it)."""

    def release(self, slot: int) -> None:
        """The request in ``slot`` finished or was aborted."""
