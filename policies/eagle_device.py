"""EAGLE's trees grown on the device: every row of a step, greedy or sampled, static tree
(EAGLE-1) or dynamic (EAGLE-2), with no read-back (``EagleProposer.propose_on_device``).

The head runs its fixed-shape forward (``engine/graphs.py``, compiled under ``step=compile``),
its inputs fused inside the graph from the tokens and the features each node is fed on
(``StaticForward.inputs``). The rules are those of the host path in ``policies/eagle.py``,
which stays the reference:

* static trees, greedy rows: level l's nodes are their parent's top-ranked tokens; under a
  cap below the tree's size (the self-tuning length, max_tokens), the levels the cap can
  reach are grown and the cap's best nodes by path log-probability kept (structure on the
  device, as a dynamic tree's);
* static trees, sampled rows: each parent's children are draws without replacement from
  the head's distribution under the row's sampling settings (Gumbel top-k over uniforms
  from the row's own generator), each node carrying the distribution it was drawn from
  given its earlier siblings; a node with no probability left (fewer possible tokens than
  the tree asks for) is a deterministic proposal, its q one-hot;
* dynamic trees (EAGLE-2): each frontier node's ``top_k`` children scored by the path's
  log-probability, the best ``top_k`` new nodes expanded next, ``depth`` levels, then the
  ``min(total_tokens - 1, room)`` best nodes by (score, depth) kept, ordered by (depth,
  score). Its size is known on the host (no node is dropped: a candidate
  outside EAGLE-3's draft vocabulary stays, a deterministic proposal scored last), its
  structure stays on the device (``DeviceTrees``). Each level feeds the frontier's
  root-to-node paths side by side (a fixed block-diagonal layout), each on its parents'
  predicted features; the head's tree KV is rolled back after every forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from specray.kernels.sampling import probs_from_logits, uniforms
from specray.kernels.tree import TokenTree
from specray.policies.base import DeviceDraft, DeviceTrees, DraftRow, ProposalRow, placeholder_tree


def dynamic_growth(options, room: int) -> tuple[int, int, int]:
    """An EAGLE-2 tree's (levels, nodes kept, width) under ``room`` (the host's and the device's):
    deeper nodes could never be kept, and growing a level or a node's children wider than the
    nodes kept changes no kept node (every kept node's ancestors are kept, a path's score only
    falling along it, so each is among its level's and its siblings' best)."""
    budget = min(options.total_tokens - 1, room)
    return min(options.depth, room), budget, min(options.top_k, budget)


def grow_on_device(proposer, rows: Sequence[ProposalRow], resolve) -> DeviceDraft:
    """Every row's tree, tokens and structure left on the device. ``resolve(row)``: the
    row's static tree (EAGLE-1 rows)."""
    root_feature, root_logits = catch_up(proposer, rows)  # [B, H], [B, V]
    device = root_logits.device
    n, vocab = len(rows), root_logits.shape[-1]
    sizes, trees, groups = [], [], {}
    for i, r in enumerate(rows):
        o = r.options
        if o.dynamic_tree:
            depth, budget, k = dynamic_growth(o, r.num_tokens)
            size = min(budget, k + (depth - 1) * k * k)
            groups.setdefault(("dynamic", k, depth, size, size), []).append(i)
            trees.append(None)
        elif r.sampling.greedy and r.num_tokens < (full := resolve(r)).size - 1:
            # capped: the tree's levels the cap can reach, then its best-scored nodes (as the host)
            size = r.num_tokens
            groups.setdefault(("best", id(full), size), []).append(i)
            trees.append(None)  # (its structure stays on the device: a placeholder on the host)
        else:
            tree = resolve(r).prefix(r.num_tokens)
            size = tree.size - 1
            groups.setdefault(("static", id(tree), not r.sampling.greedy), []).append(i)
            trees.append(tree)
        sizes.append(size)
    width = max(max(sizes), 1)
    tokens = torch.zeros(n, width, dtype=torch.long, device=device)
    probs, with_probs, built = None, [False] * n, []
    for key, idx in groups.items():
        sel = torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True)
        sub = [rows[i] for i in idx]
        if key[0] == "dynamic":
            _, k, depth, budget, size = key
            toks, parents = grow_dynamic(proposer, sub, root_feature[sel], root_logits[sel], k, depth, budget, size)
            tokens[sel, :size] = toks
            built.append(DeviceTrees(idx, parents, depth, k))
            continue
        if key[0] == "best":
            tree, size = resolve(sub[0]), key[2]
            tree = tree.prefix(sum(len(c) <= size for c in tree.choices))  # its levels a cap reaches (no read)
            toks, score = grow_static(proposer, tree, sub, root_feature[sel], root_logits[sel], sampled=False,
                                      scored=True)
            par, dep = (t[1:].to(device).expand_as(toks) for t in (tree.parents - 1, tree.depth))  # par -1: the root
            toks, parents = _select(toks, par, score, dep, size, size)
            tokens[sel, :size] = toks
            built.append(DeviceTrees(idx, parents, tree.max_depth, max(1, int(tree.children_table.shape[1]))))
            continue
        tree = trees[idx[0]]
        if tree.size == 1:
            continue
        toks, q = grow_static(proposer, tree, sub, root_feature[sel], root_logits[sel], sampled=key[2])
        tokens[sel, : tree.size - 1] = toks
        if q is not None:
            if probs is None:
                probs = torch.zeros(n, width, vocab, device=device)
            probs[sel, : tree.size - 1] = q
            for i in idx:
                with_probs[i] = True
    placeholders = [DraftRow([0] * s, placeholder_tree(s) if t is None else t) for s, t in zip(sizes, trees)]
    return DeviceDraft(placeholders, tokens, probs, with_probs if probs is not None else None, built)


def catch_up(proposer, rows: Sequence[ProposalRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed each row's committed pairs through the head's fixed-shape forward; f̂ [B, H] and
    logits [B, V] at its last one (the new root)."""
    head, runner = proposer.head, proposer.runner
    slots, tokens, feats = [], [], []
    for row in rows:
        fs, toks = proposer._pending.pop(row.slot, ([], []))
        if not toks:
            raise ValueError(f"eagle: no committed features for slot {row.slot} (missing prefill/commit)")
        slots.append(row.slot)
        tokens.append(toks)
        feats.append(head.target_features(torch.cat(fs).to(runner.dtype)))  # [q_i, H]
    width = max(map(len, tokens))
    padded = feats[0].new_zeros(len(rows), width, feats[0].shape[-1])  # [B, q, H]
    for i, f in enumerate(feats):
        padded[i, : f.shape[0]] = f
    out = runner.static.run(slots, tokens, feats=padded)
    last = torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long).to(padded.device, non_blocking=True)
    every = torch.arange(len(rows), device=padded.device)
    return out.hidden[every, last], out.logits[every, last]


def _run_nodes(proposer, slots, tokens, feats, layout):
    """One head forward over nodes fed on the given features (tokens [b, m] and feats
    [b, m, H] on the device) under ``layout`` ([m, m] mask, [m] offsets, host); the head's
    cache is rolled back after it (a tree's KV is never kept). Returns (hidden, logits)."""
    runner = proposer.runner
    b, m = tokens.shape
    mask, offsets = layout
    base = [runner.lengths[s] for s in slots]
    every = torch.arange(b, device=tokens.device)
    out = runner.static.run(slots, [[0] * m] * b, (mask.expand(b, -1, -1), offsets.expand(b, -1)),
                            spliced=[(every, 0, tokens)], feats=feats)
    for s, n in zip(slots, base):
        runner.set_length(s, n)
    return out.hidden[:b, :m], out.logits[:b, :m]


# -- static trees (EAGLE-1) ---------------------------------------------------------------
def grow_static(proposer, tree: TokenTree, rows: Sequence[ProposalRow], root_feature: torch.Tensor,
                root_logits: torch.Tensor, sampled: bool, scored: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A static tree's tokens [b, T-1] (and, sampled, the q each node was drawn from
    [b, T-1, V]; ``scored``, greedy rows: each node's path log-probability [b, T-1] as the
    host scores it) for rows that share it. Level l's forward feeds every node above it (a node
    sees only its ancestors, so feeding more than the frontier's changes nothing), each on
    its parent's predicted feature; its logits give level l's tokens."""
    shape = _tree_levels(tree)
    b, size, vocab = len(rows), tree.size, root_logits.shape[-1]
    device = root_logits.device
    slots = [r.slot for r in rows]
    tokens = torch.zeros(b, size - 1, dtype=torch.long, device=device)
    probs = torch.zeros(b, size - 1, vocab, device=device) if sampled else None
    feats = root_feature.new_zeros(b, size, root_feature.shape[-1])  # node n's predicted feature (0: root)
    feats[:, 0] = root_feature
    parent_logits = root_logits[:, None]  # [b, 1, V]: the root's
    score = torch.zeros(b, size - 1, device=device) if scored else None
    if sampled:
        params = _sampling(rows, device)
        u = uniforms([shape.draws * vocab] * b, [r.generator for r in rows], device).clamp_(1e-12, 1 - 1e-12)
        drawn = 0
    for level, (nodes, parent_cols, each, ranks, k) in enumerate(shape.levels, start=1):
        if level > 1:
            fed = shape.starts[level - 1] - 1  # nodes 1..fed sit above this level
            mask, offsets = shape.layouts[level - 1]
            hidden, parent_logits = _run_nodes(proposer, slots, tokens[:, :fed], feats[:, shape.parents[1 : fed + 1]],
                                               (mask[0], offsets[0]))
            feats[:, 1 : fed + 1] = hidden
        if not sampled:
            top = parent_logits[:, parent_cols].topk(k, dim=-1)  # [b, n_l, k]
            tokens[:, nodes - 1] = top.indices[:, each, ranks]
            if scored:
                logp = top.values.float() - torch.logsumexp(parent_logits[:, parent_cols].float(), dim=-1, keepdim=True)
                above = (shape.parents[nodes] - 1).to(device)  # -1: the root
                base = torch.where(above >= 0, score.gather(1, above.clamp(min=0).expand(b, -1)), 0.0)
                score[:, nodes - 1] = base + logp[:, each, ranks]
            continue
        owners, which = shape.owners[level - 1]  # the level's distinct parents; each node's among them
        m = len(owners)
        logits = parent_logits[:, owners].reshape(b * m, vocab).float()
        q = probs_from_logits(logits, *(p.repeat_interleave(m) for p in params), check=False).view(b, m, vocab)
        picks, qs = draw_without_replacement(q, u[:, drawn : drawn + m * vocab].view(b, m, vocab), k)
        drawn += m * vocab
        tokens[:, nodes - 1] = picks[:, which, ranks]
        probs[:, nodes - 1] = qs[:, which, ranks]
    return tokens, (score if scored else probs)


def draw_without_replacement(q: torch.Tensor, u: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement from each q [..., V] (Gumbel top-k over uniforms u
    [..., V]): picks [..., k] in draw order and the distribution each was drawn from given
    the earlier ones [..., k, V] (q with them removed, renormalised; one-hot where nothing is
    left: such a pick is a deterministic proposal)."""
    keys = torch.where(q > 0, torch.log(q) - torch.log(-torch.log(u)), float("-inf"))
    picks = keys.topk(k, dim=-1).indices  # [..., k]
    onehot = torch.zeros(*q.shape[:-1], k, q.shape[-1], device=q.device).scatter_(-1, picks[..., None], 1.0)
    left = q[..., None, :] * (1 - (onehot.cumsum(dim=-2) - onehot))  # [..., k, V]: earlier picks removed
    mass = left.sum(dim=-1, keepdim=True)
    return picks, torch.where(mass > 0, left / mass.clamp_min(1e-30), onehot)


def _sampling(rows: Sequence[ProposalRow], device) -> list[torch.Tensor]:
    """(temperature, top_k, top_p) [b] per row."""
    return [torch.tensor([getattr(r.sampling, name) for r in rows], dtype=dt).to(device, non_blocking=True)
            for name, dt in (("temperature", torch.float32), ("top_k", torch.long), ("top_p", torch.float32))]


# -- dynamic trees (EAGLE-2) ---------------------------------------------------------------
def grow_dynamic(proposer, rows: Sequence[ProposalRow], root_feature: torch.Tensor, root_logits: torch.Tensor,
                 k: int, depth: int, budget: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's trees for rows sharing (top_k, depth, budget, size): tokens [b, size] and parents
    [b, size] (node i + 1 under node parents[:, i], 0 = the root), ordered by depth, parents
    first. Candidates live in fixed arrays of N = k + (depth - 1) k^2 nodes: level 1's k,
    then k^2 per level (k children of each of the k frontier nodes)."""
    b, device = len(rows), root_logits.device
    n = k + (depth - 1) * k * k
    # Greedy rows score with the head's calibrated confidence (EagleHead.greedy_temperature).
    scale = torch.tensor([proposer.head.greedy_temperature if r.sampling.greedy else 1.0 for r in rows],
                         dtype=torch.float32).to(device, non_blocking=True)  # [b]
    tok = torch.zeros(b, n, dtype=torch.long, device=device)
    par = torch.full((b, n), -1, dtype=torch.long, device=device)  # -1: under the root
    score = torch.zeros(b, n, device=device)  # log of the product of the head's probabilities along the path
    dep = torch.ones(b, n, dtype=torch.long, device=device)
    paths = torch.zeros(b, n, depth, dtype=torch.long, device=device)  # each node's path, by depth
    known = root_feature.new_zeros(b, n, root_feature.shape[-1])  # f̂ of nodes once expanded
    logp = torch.log_softmax(root_logits.float() / scale[:, None], dim=-1)  # [b, V]
    val, idx = logp.topk(k, dim=-1)
    tok[:, :k], score[:, :k] = idx, val
    paths[:, :k, 0] = torch.arange(k, device=device)
    frontier = torch.arange(k, device=device).expand(b, -1)  # [b, k] best first
    slots = [r.slot for r in rows]
    for level in range(2, depth + 1):
        m = level - 1  # nodes on each frontier node's path
        fed = paths.gather(1, frontier[..., None].expand(-1, -1, depth))[..., :m].reshape(b, k * m)  # [b, k m]
        above = par.gather(1, fed)
        parent_feats = torch.where((above >= 0)[..., None],
                                   known.gather(1, above.clamp(min=0)[..., None].expand(-1, -1, known.shape[-1])),
                                   root_feature[:, None])
        hidden, logits = _run_nodes(proposer, slots, tok.gather(1, fed), parent_feats, _paths_layout(k, m))
        ends = torch.arange(k, device=device) * m + (m - 1)  # each path's last node: the frontier node
        known.scatter_(1, frontier[..., None].expand(-1, -1, known.shape[-1]), hidden[:, ends])
        logp = torch.log_softmax(logits[:, ends].float() / scale[:, None, None], dim=-1)  # [b, k, V]
        val, idx = logp.topk(k, dim=-1)  # [b, k, k]
        start = k + (level - 2) * k * k
        new = slice(start, start + k * k)
        tok[:, new] = idx.reshape(b, -1)
        score[:, new] = (score.gather(1, frontier)[..., None] + val).reshape(b, -1)
        par[:, new] = frontier[..., None].expand(-1, -1, k).reshape(b, -1)
        dep[:, new] = level
        above_paths = paths.gather(1, frontier[..., None].expand(-1, -1, depth))  # [b, k, depth]
        grown = above_paths[:, :, None].expand(-1, -1, k, -1).reshape(b, k * k, depth).clone()
        grown[..., m] = torch.arange(start, start + k * k, device=device)
        paths[:, new] = grown
        # the next frontier: the best k new nodes (ties: creation order, as the host's sort)
        frontier = start + torch.sort(-score[:, new], dim=1, stable=True).indices[:, :k]
    return _select(tok, par, score, dep, budget, size)


def _select(tok, par, score, dep, budget: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``budget`` best nodes by (score, depth, creation), then ordered by (depth, score)
    and cut to ``size`` (the row's room): tokens and parents (indices into the kept nodes,
    0 = the root) [b, size]. A child never scores above its parent, so parents come along."""
    b, n = tok.shape
    device = tok.device
    by_depth = torch.sort(dep, dim=1, stable=True).indices
    best = by_depth.gather(1, torch.sort(-score.gather(1, by_depth), dim=1, stable=True).indices)[:, :budget]
    chosen = best.gather(1, torch.sort(dep.gather(1, best), dim=1, stable=True).indices)[:, :size]
    at = torch.zeros(b, n, dtype=torch.long, device=device)
    at.scatter_(1, chosen, torch.arange(1, chosen.shape[1] + 1, device=device).expand(b, -1))
    above = par.gather(1, chosen)
    parents = torch.where(above >= 0, at.gather(1, above.clamp(min=0)), 0)
    return tok.gather(1, chosen), parents


@lru_cache(maxsize=256)
def _paths_layout(k: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k root-to-node paths of m nodes side by side: ([k m, k m] mask, each node sees its
    path's earlier nodes; [k m] offsets, its depth - 1)."""
    block = np.tril(np.ones((m, m), dtype=bool))
    mask = np.kron(np.eye(k, dtype=bool), block)
    return torch.from_numpy(mask), torch.arange(m).repeat(k)


@dataclass(frozen=True)
class _Levels:
    """A static tree's constants for growing it level by level on the device (cached).

    levels:  per level l >= 1: (its nodes [n_l], their parents' columns in the level's
             parent logits [n_l], arange(n_l), their ranks [n_l], the top-k it needs)
    owners:  per level: (its distinct parents' columns [u_l], each node's index among them
             [n_l]) (sampled rows draw once per parent)
    draws:   sum of u_l: the parents that draw children
    starts:  first node index of each level (levels[l - 1] starts at starts[l - 1])
    parents: [T] each node's parent (root: 0)
    columns: [T] 0 .. T-1, the fed nodes' logit columns
    layouts: per level l >= 2, (mask [1, m, m], offsets [1, m]) over nodes 1..m above it
    """

    levels: list
    starts: list
    parents: torch.Tensor
    columns: torch.Tensor
    layouts: dict
    owners: list
    draws: int


_LEVELS: dict[int, tuple[TokenTree, _Levels]] = {}  # id(tree) -> (the tree, its levels); trees are cached


def _tree_levels(tree: TokenTree) -> _Levels:
    hit = _LEVELS.get(id(tree))
    if hit is None or hit[0] is not tree:
        if len(_LEVELS) > 256:
            _LEVELS.clear()
        hit = _LEVELS[id(tree)] = (tree, _levels(tree))
    return hit[1]


def _levels(tree: TokenTree) -> _Levels:
    depth = tree.depth.numpy()
    parents = tree.parents.clamp(min=0)
    starts, levels, layouts, owners = [], [], {}, []
    for level in range(1, tree.max_depth + 1):
        nodes = np.flatnonzero(depth == level)
        starts.append(int(nodes[0]))
        par = parents[nodes]
        # the parents' columns: the root's logits alone at level 1, else the fed nodes 1..m
        cols = par * 0 if level == 1 else par - 1
        distinct, which = np.unique(cols.numpy(), return_inverse=True)
        owners.append((torch.from_numpy(distinct), torch.from_numpy(which.reshape(-1))))
        ranks = torch.tensor([tree.choices[n - 1][-1] for n in nodes])
        levels.append((torch.from_numpy(nodes), cols, torch.arange(len(nodes)), ranks, tree.topk[level - 1]))
        if level > 1:
            m = starts[-1] - 1
            layouts[level - 1] = (tree.mask[1 : m + 1, 1 : m + 1][None], (tree.depth[1 : m + 1] - 1)[None])
    return _Levels(levels, starts, parents, torch.arange(tree.size), layouts, owners, sum(len(o) for o, _ in owners))
