"""Token trees for tree speculation (Medusa ``medusa_choices``, EAGLE's and ReDrafter's trees).

A tree is a list of candidates, each a path of top-k indices: ``(0,)`` is head 0's
most likely token, ``(0, 1)`` head 1's second choice after it, and so on. The root (the
last committed token, verified for free) is implicit. TensorRT-LLM documents two ways to
write ``medusa_choices``: every candidate listed explicitly, or only the unique paths,
which stand for all their prefixes. ``[[0,0,0,0],[0,1,0],[1,0],[1,1]]`` (paths) is the
nine candidates ``[0] [0,0] [0,0,0] [0,0,0,0] [0,1] [0,1,0] [1] [1,0] [1,1]``, so the target
checks 10 tokens per step.

Node order: node 0 is the root, node i >= 1 is ``choices[i - 1]`` sorted by (length, path).
The tree's parents, ancestor mask and depths are derived from the parents of the sorted
choices (``_from_parents``); where xformers is installed, its
``xformers.ops.tree_attention.TreeAttnMetadata`` builds the same (xformers is optional).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Literal, Sequence

import numpy as np
import torch

logging.getLogger("xformers").setLevel(logging.ERROR)  # "can't load C++/CUDA extensions" on CPU

Form = Literal["auto", "explicit", "paths"]


class TreeError(ValueError):
    """A malformed ``medusa_choices`` tree."""


def normalize_choices(choices: Sequence[Sequence[int]], form: Form = "auto", max_depth: int | None = None) -> tuple:
    """Validate ``choices`` and return every candidate as sorted tuples.

    form: ``explicit`` (every candidate listed, each one's parent too), ``paths`` (unique
    paths, expanded to all their prefixes) or ``auto`` (explicit when every parent is
    listed, else paths).
    """
    if not choices:
        raise TreeError("medusa_choices is empty: need at least one candidate path")
    paths = []
    for c in choices:
        if isinstance(c, (str, bytes)) or not hasattr(c, "__len__") or len(c) == 0:
            raise TreeError(f"each candidate must be a non-empty list of indices, got {c!r}")
        if any(not isinstance(i, int) or isinstance(i, bool) for i in c):
            raise TreeError(f"candidate {list(c)} must hold integers")
        if any(i < 0 for i in c):
            raise TreeError(f"candidate {list(c)} has a negative index")
        paths.append(tuple(c))
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise TreeError(f"candidate {list(dup)} is listed twice")
    given = set(paths)
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in given]
    if form == "explicit" and missing:
        raise TreeError(f"candidate {list(missing[0])} has no parent {list(missing[0][:-1])} (explicit form)")
    if form == "paths" or (form == "auto" and missing):
        given = {p[:n] for p in paths for n in range(1, len(p) + 1)}
    depth = max(len(p) for p in given)
    if max_depth is not None and depth > max_depth:
        raise TreeError(f"tree depth {depth} exceeds the {max_depth} draft heads available")
    return tuple(sorted(given, key=lambda p: (len(p), p)))


@dataclass(frozen=True)
class TokenTree:
    """One tree's structure (CPU tensors; the root is node 0; a parent precedes its children).

    parents:      [T] int64, parent node of each node (root: -1)
    mask:         [T, T] bool, node j attends to node i (its ancestors and itself)
    depth:        [T] int64, 0 for the root (added to the row's length for position ids)
    choices:      Medusa-style rank paths, node i >= 1 is choices[i - 1] (None for trees
                  built from parents, e.g. EAGLE-2's dynamic trees)
    topk:         [D] candidates each head must provide (max index + 1 per level; choices only)
    """

    parents: torch.Tensor
    mask: torch.Tensor
    depth: torch.Tensor
    choices: tuple | None = None
    topk: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return int(self.depth.shape[0])

    @cached_property
    def max_depth(self) -> int:
        return int(self.depth.numpy().max())  # host tensors (.numpy() refuses device ones)

    @staticmethod
    def from_parents(parents: Sequence[int]) -> "TokenTree":
        """The tree whose node i + 1 hangs under node ``parents[i]`` (0 = the root).

        Parents must precede their children. Cached per distinct shape: static trees cost
        nothing per step, and a dynamic one costs one pass over its nodes.
        """
        return _from_parents(tuple(int(p) for p in parents))

    def candidate_tokens(self, head_topk: torch.Tensor) -> torch.Tensor:
        """Tokens of the non-root nodes from each head's ranked candidates (choices trees).

        head_topk: [B, D, K] int64, head d's top-K tokens (K >= max(topk))
        returns:   [B, T-1] int64, the token of node i (i >= 1) at column i - 1
        """
        level, rank = self._level_rank
        return head_topk[:, level, rank]

    # Per-tree constants that proposing and accepting read every step; trees are cached
    # (``build_tree``, ``from_parents``), so these are computed once per distinct tree.
    @cached_property
    def _level_rank(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([len(c) - 1 for c in self.choices]), torch.tensor([c[-1] for c in self.choices])

    @cached_property
    def children(self) -> list[list[int]]:
        """Each node's children in node order (for choices trees, that is rank order)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for node, parent in enumerate(self.parents.numpy().tolist()[1:], start=1):
            kids[parent].append(node)
        return kids

    def prefix(self, n: int) -> "TokenTree":
        """The tree of the root and its first ``n`` nodes (cached). Nodes are ordered by depth
        with parents first, so every kept node's parent is kept: a cut costs slicing, not a
        rebuild (and reads no tensor back)."""
        if n >= self.size - 1:
            return self
        cut = self._prefixes.get(n)
        if cut is None:
            choices = self.choices[:n] if self.choices is not None else None
            topk = () if choices is None else tuple(
                max(c[level] for c in choices if len(c) > level) + 1 for level in range(max(len(c) for c in choices)))
            m = n + 1
            cut = self._prefixes[n] = TokenTree(parents=self.parents[:m], mask=self.mask[:m, :m].contiguous(),
                                                depth=self.depth[:m], choices=choices, topk=topk)
        return cut

    @cached_property
    def _prefixes(self) -> dict:
        return {}

    @cached_property
    def children_table(self) -> torch.Tensor:
        """[T, C] each node's children in node order, padded with -1 (C >= 1)."""
        width = max(1, max(len(k) for k in self.children))
        return torch.tensor([k + [-1] * (width - len(k)) for k in self.children], dtype=torch.long)

    @cached_property
    def paths(self) -> torch.Tensor:
        """[P, D+1] int64 root-to-leaf node indices, padded with -1 (one row per leaf)."""
        parents = self.parents.numpy().tolist()
        leaves = [n for n in range(self.size) if not self.children[n]]
        rows = []
        for leaf in leaves:
            path = [leaf]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            rows.append(path[::-1])
        width = max(map(len, rows))
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


@lru_cache(maxsize=1024)
def _from_parents(parents: tuple) -> TokenTree:
    n = len(parents) + 1
    par = np.full(n, -1, dtype=np.int64)
    par[1:] = parents
    if n > 1 and ((par[1:] < 0) | (par[1:] >= np.arange(1, n))).any():
        raise TreeError(f"every node's parent must be an earlier node (0 = root), got parents {list(parents)}")
    mask = np.eye(n, dtype=bool)
    depth = np.zeros(n, dtype=np.int64)
    for node in range(1, n):
        mask[node] |= mask[par[node]]
        depth[node] = depth[par[node]] + 1
    return TokenTree(parents=torch.from_numpy(par), mask=torch.from_numpy(mask), depth=torch.from_numpy(depth))


def chain_tree(length: int) -> TokenTree:
    """A chain of ``length`` nodes below the root."""
    return _from_parents(tuple(range(length)))


@lru_cache(maxsize=64)
def _build(choices: tuple) -> TokenTree:
    depth_levels = max(len(c) for c in choices)
    topk = tuple(max(c[level] for c in choices if len(c) > level) + 1 for level in range(depth_levels))
    base = _xformers_tree(choices) or _parents_tree(choices)
    return TokenTree(parents=base.parents, mask=base.mask, depth=base.depth, choices=choices, topk=topk)


def _parents_tree(choices: tuple) -> TokenTree:
    """The tree of sorted choices from each one's parent path."""
    index = {c: i + 1 for i, c in enumerate(choices)}
    return _from_parents(tuple(index.get(c[:-1], 0) for c in choices))


def _xformers_tree(choices: tuple) -> TokenTree | None:
    """The same tree from xformers' ``TreeAttnMetadata`` (its CPU metadata, no kernels), or
    None where xformers is not installed (the optional "xformers" extra) or fails to import."""
    try:
        from xformers.ops.tree_attention import TreeAttnMetadata
    except Exception:  # noqa: BLE001 - ImportError, or a broken build failing at import
        return None
    meta = TreeAttnMetadata.from_tree_choices(list(choices), torch.float32, "cpu")
    mask = meta.attention_bias == 0  # [T, T], 0 = attend
    # xformers lists the parents of the non-root nodes, as root-inclusive node indices.
    parents = torch.cat([torch.tensor([-1]), meta.parent_node_indices.long()])
    return TokenTree(parents=parents, mask=mask, depth=meta.tree_seq_position_ids.long())


def build_tree(choices: Sequence[Sequence[int]], form: Form = "auto", max_depth: int | None = None) -> TokenTree:
    """A validated ``TokenTree`` for ``medusa_choices`` (cached per distinct tree).

    Proposers call this every step with the request's choices, so the cache is keyed on the
    choices as given: a repeat costs a tuple conversion, not a re-validation."""
    if isinstance(choices, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in choices):
        try:
            return _build_given(tuple(tuple(c) for c in choices), form, max_depth)
        except TypeError:  # unhashable entries: validation below says what is wrong
            pass
    return _build(normalize_choices(choices, form, max_depth))


@lru_cache(maxsize=256)
def _build_given(choices: tuple, form: Form, max_depth: int | None) -> TokenTree:
    return _build(normalize_choices(choices, form, max_depth))


def chain(length: int) -> list[list[int]]:
    """A linear tree: the top-1 candidate of each of ``length`` heads."""
    return [[0] * n for n in range(1, length + 1)]


# Named trees: a chain, TensorRT-LLM's documented example, a wider two-level tree.
NAMED_TREES = {
    "chain": chain(4),
    "trtllm_example": [[0, 0, 0, 0], [0, 1, 0], [1, 0], [1, 1]],
    "wide": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]],
}


# -- trees built on the device (EAGLE-2, ReDrafter): their structure never leaves it ---------
def device_layout(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Trees given by their parents, as tensors on the parents' device (no read-back).

    parents:   [B, T] int64, node i + 1 hangs under node parents[b, i] (0 = the root); a
               parent precedes its children
    max_depth: an upper bound of the trees' depth (a host int: how many hops to walk)
    returns:   (anc [B, T + 1, T + 1] bool, anc[b, j, i]: node i is node j's ancestor or j
               itself; depth [B, T + 1] int64, 0 at the root)
    """
    b, t = parents.shape
    up = torch.cat([parents.new_zeros(b, 1), parents], dim=1)  # [B, T + 1]: the root is its own parent
    cur = torch.arange(t + 1, device=parents.device).expand(b, -1)
    anc = torch.zeros(b, t + 1, t + 1, dtype=torch.bool, device=parents.device)
    anc.scatter_(2, cur[..., None], True)
    for _ in range(max_depth):
        cur = up.gather(1, cur)
        anc.scatter_(2, cur[..., None], True)
    return anc, anc.sum(dim=-1) - 1


def device_children(parents: torch.Tensor, max_children: int) -> torch.Tensor:
    """[B, T + 1, C] each node's children in node order, padded with -1 (C = max_children,
    an upper bound), from parents [B, T] as in ``device_layout``."""
    b, t = parents.shape
    nodes = torch.arange(1, t + 1, device=parents.device)
    owner = torch.arange(t + 1, device=parents.device)
    is_child = parents[:, None, :] == owner[None, :, None]  # [B, T + 1, T]: node i + 1 hangs under j
    key = torch.where(is_child, nodes, t + 1)
    kids = key.sort(dim=-1).values[..., :max_children]
    if kids.shape[-1] < max_children:
        kids = torch.cat([kids, kids.new_full((b, t + 1, max_children - kids.shape[-1]), t + 1)], dim=-1)
    return torch.where(kids > t, -1, kids)
