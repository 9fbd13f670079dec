"""Acceptance for a whole padded batch on the device, with no host reads.

The rules are those of ``kernels/acceptance.py`` (chains) and ``kernels/tree_acceptance.py``
(trees), whose per-row versions stay the reference; here every row of a fixed-shape
verification is handled at once, with tensor ops only, so that a step reads back one
small buffer (accepted counts, paths, emitted tokens) instead of syncing per row.

Each row is a tree over the W new positions of its verification (a chain is the tree
whose node j hangs under j - 1):

    tokens  [B, W] int64  node tokens; node 0 is the root (the last committed token)
    anc     [B, W, W] bool  anc[b, j, i]: node i is node j's ancestor or j itself (the
            verification's attention mask restricted to the tree)
    depth   [B, W] int64  0 for the root
    sizes   [B] int64     draft nodes per row: nodes 1..sizes[b] may be accepted; the
            rest (a lookahead window, padding) never are

Greedy (token match, lossless): node j is *alive* iff every node on its root path
(root excluded) carries the target's argmax at its parent. Sibling tokens are distinct,
so the alive nodes form one path; its deepest node ends the accepted path, and the
target's argmax there is the recovered/bonus token. One expression, no loop over depth.

Sampling (lossless): chains use speculative sampling (``rejection_accept``); trees use
recursive rejection over each node's children, walked one level per iteration for the
whole batch, each row drawing a fixed number of uniforms from its own generator
(``tree_uniform_count``) so its result does not depend on the batch around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample_from_uniform


@dataclass(frozen=True)
class BatchAcceptance:
    """Per row (device tensors, padded to W):

    num_accepted: [B] int64 accepted draft nodes
    path:         [B, W] int64 kept node indices by depth (root first); valid up to
                  num_accepted, 0 after
    emitted:      [B, W] int64 accepted node tokens then the recovered/bonus token; valid
                  up to num_accepted + 1, 0 after
    """

    num_accepted: torch.Tensor
    path: torch.Tensor
    emitted: torch.Tensor


def greedy_accept_batch(tokens: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor, sizes: torch.Tensor,
                        best: torch.Tensor) -> BatchAcceptance:
    """best: [B, W] the target's argmax at every node. Chains and trees alike.

    >>> t = torch.tensor([[5, 6, 7]]); anc = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    >>> r = greedy_accept_batch(t, anc, torch.arange(3)[None], torch.tensor([2]), torch.tensor([[6, 9, 1]]))
    >>> r.num_accepted.tolist(), r.emitted[0, :2].tolist()    # 6 matches, 7 does not (9)
    ([1], [6, 9])
    """
    width = tokens.shape[1]
    col = torch.arange(width, device=tokens.device)
    parents = parent_nodes(anc, depth)  # [B, W]
    acceptable = (col[None, :] >= 1) & (col[None, :] <= sizes[:, None])  # [B, W]
    match = acceptable & (tokens == best.gather(1, parents))
    match = match | (col[None, :] == 0)  # the root is always kept
    alive = (~anc | match[:, None, :]).all(dim=-1)  # [B, W]: every ancestor-or-self matches
    end = torch.where(alive, depth, -1).argmax(dim=1)  # [B] the deepest alive node
    final = best.gather(1, end[:, None])  # [B, 1]
    return _assemble(tokens, anc, depth, end, final)


def parent_nodes(anc: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """[B, W] each node's parent: its ancestor one level up (the root, and nodes with no
    such ancestor, get 0)."""
    one_up = anc & (depth[:, None, :] == depth[:, :, None] - 1)  # [B, W(j), W(i)]
    # A tree has at most one such ancestor: the largest index where one_up holds is it. Not
    # argmax over one_up as uint8: inductor's AVX-512 code for that reduction wrote indices
    # out of range (torch 2.13, compiled greedy_pass: test_compiled_greedy_pass_equals_eager)
    col = torch.arange(anc.shape[-1], device=anc.device)
    return torch.where(one_up, col, 0).amax(dim=-1)


def _assemble(tokens, anc, depth, end, final) -> BatchAcceptance:
    """The path to ``end`` [B] by depth, its tokens, then ``final`` [B, 1]."""
    b, width = tokens.shape
    num_accepted = depth.gather(1, end[:, None]).squeeze(1)  # [B]
    on_path = anc.gather(1, end[:, None, None].expand(-1, 1, width)).squeeze(1)  # [B, W]
    slot = torch.where(on_path, depth, width)  # nodes off the path go to a dump column
    nodes = torch.arange(width, device=tokens.device).expand(b, -1)
    path = torch.zeros(b, width + 1, dtype=torch.long, device=tokens.device).scatter_(1, slot, nodes)[:, :width]
    col = torch.arange(width, device=tokens.device)
    path = torch.where(col[None, :] <= num_accepted[:, None], path, 0)
    # node tokens after the root; a roll, not cat(path[:, 1:], path[:, :1]): a slice of width
    # W - 1 made dynamo specialise W = 2 (its size-1 case) and recompile for every other width
    emitted = tokens.gather(1, torch.roll(path, -1, dims=1))
    emitted = torch.where(col[None, :] < num_accepted[:, None], emitted, 0)
    emitted = emitted.scatter(1, num_accepted[:, None], final)
    return BatchAcceptance(num_accepted, path, emitted)


def tree_uniform_count(depth: int, max_children: int) -> int:
    """Uniforms a sampled tree row draws: one per (level, sibling) test, one final."""
    return depth * max_children + 1


def tree_rejection_accept_batch(
    tokens: torch.Tensor,  # [S, W] int64
    anc: torch.Tensor,  # [S, W, W] bool
    depth: torch.Tensor,  # [S, W] int64
    children: torch.Tensor,  # [S, W, C] int64, each node's children in try order, -1 padded
    probs: torch.Tensor,  # [S, W, V] the target's distributions (after temperature/top-k/top-p)
    u: torch.Tensor,  # [S, U] uniforms: row s uses u[s, d * strides[s] + c] and u[s, finals[s]]
    strides: torch.Tensor,  # [S] int64 the row's own max children
    finals: torch.Tensor,  # [S] int64 the column of the row's final uniform
    levels: int,  # the deepest tree's depth
    draft_probs: torch.Tensor | None = None,  # [S, W, V] q each node was drawn from, or None
    has_q: torch.Tensor | None = None,  # [S] bool rows whose nodes carry q (else one-hot)
) -> BatchAcceptance:
    """Recursive rejection over siblings (SpecInfer; ``tree_rejection_accept``), all rows at
    once: at the current node, start from r = p and try its children in order; accept child
    c with probability min(1, r(x_c) / (|r| q_c(x_c))) (one-hot q: r(x_c) / |r|); on
    rejection r <- max(0, r / |r| - q_c) (one-hot: zero r(x_c)); when every child is
    rejected, or at a leaf, emit a token from r. Exact for any q."""
    s, width = tokens.shape
    c_max = children.shape[2]
    device = tokens.device
    ar = torch.arange(s, device=device)
    cur = torch.zeros(s, dtype=torch.long, device=device)
    active = torch.ones(s, dtype=torch.bool, device=device)
    final_r = probs[:, 0].clone()  # [S, V]
    onehot = torch.ones(s, dtype=torch.bool, device=device) if has_q is None or draft_probs is None else ~has_q
    for d in range(levels):
        r = probs[ar, cur].double()  # [S, V] residual at the current node (unnormalized)
        kids = children[ar, cur]  # [S, C]
        chosen = torch.full((s,), -1, dtype=torch.long, device=device)
        searching = active.clone()
        for c in range(c_max):
            child = kids[:, c]
            valid = searching & (child >= 0)
            node = child.clamp(min=0)
            tok = tokens.gather(1, node[:, None])  # [S, 1]
            mass = r.sum(dim=1)  # [S]
            col = (d * strides + c).clamp(max=u.shape[1] - 1)
            uu = u.gather(1, col[:, None]).squeeze(1).double()  # [S]
            r_tok = r.gather(1, tok).squeeze(1)  # [S]
            if draft_probs is not None:
                q = draft_probs[ar, node].double()  # [S, V]
                q_tok = torch.where(onehot, 1.0, q.gather(1, tok).squeeze(1))
            else:
                q_tok = torch.ones_like(r_tok)
            ok = valid & (mass > 0) & (uu * q_tok * mass < r_tok)
            chosen = torch.where(ok, child, chosen)
            searching = searching & ~ok
            rejected = valid & ~ok
            # One-hot q: zero r(x_c). Drawn q: r <- max(0, r/|r| - q).
            zeroed = r.scatter(1, tok, 0.0)
            if draft_probs is not None:
                residual = (r / mass.clamp_min(1e-300)[:, None] - q).clamp_min(0.0)
                updated = torch.where(onehot[:, None], zeroed, torch.where((mass > 0)[:, None], residual, r))
            else:
                updated = zeroed
            r = torch.where(rejected[:, None], updated, r)
        moved = active & (chosen >= 0)
        stopped = active & ~moved
        final_r = torch.where(stopped[:, None], r.to(final_r.dtype), final_r)
        cur = torch.where(moved, chosen, cur)
        active = moved
    leaf = probs[ar, cur]
    final_r = torch.where(active[:, None], leaf, final_r)  # rows that reached their deepest level
    empty = final_r.sum(dim=1, keepdim=True) <= 0  # float corner: fall back to the target itself
    final_r = torch.where(empty, leaf, final_r)
    final = sample_from_uniform(final_r, u.gather(1, finals[:, None]).squeeze(1))
    return _assemble(tokens, anc, depth, cur, final[:, None])
