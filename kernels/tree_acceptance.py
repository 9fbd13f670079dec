"""Acceptance on token trees: which root-to-node path the target keeps.

Terms as in ``kernels/acceptance.py``: the accepted tokens are the kept path's nodes,
then one recovered or bonus token. Per row (trees are small; a row loop over depth):

* greedy (lossless): from the root, follow the child whose token equals the target's
  argmax; stop at a node with no such child and emit that argmax.
* exact sampling (lossless, any temperature/top-p/top-k): recursive rejection over
  siblings (SpecInfer's multi-step speculative sampling; EAGLE's tree sampling). At a
  node, start from the residual r = p (the target's distribution there) and try its
  children in order; child c carries the distribution q_c it was drawn from (given the
  siblings drawn before it), or is a deterministic proposal (q_c one-hot). Accept c with
  probability min(1, r(x_c) / q_c(x_c)); on rejection set r = norm(max(0, r - q_c)) and try
  the next sibling; if all are rejected, emit a token sampled from r; at a leaf, emit the
  bonus token from p. Each sibling test is one step of speculative sampling against the
  current residual, so the emitted tokens are distributed exactly as the target's. For
  one-hot q the update is "zero r(x_c)", which is Medusa's case (top-k candidates are a
  fixed function of the prefix).
* typical acceptance (Medusa; LOSSY, opt-in): a child is acceptable when
  p(c) > min(posterior_threshold, posterior_alpha * exp(-H(p))); follow the most likely
  acceptable child; emit a sample from p at the end (greedy rows use the greedy rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specray.kernels.tree import TokenTree


@dataclass(frozen=True)
class TreeAcceptance:
    """path: kept node indices, root first; emitted: accepted node tokens + the final token."""

    path: list[int]
    emitted: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def tree_greedy_accept(tree: TokenTree, tokens: Sequence[int], best: Sequence[int]) -> TreeAcceptance:
    """tokens: [T] node tokens (node 0 = root); best: [T] the target's argmax at each node."""
    kids = tree.children
    node, path = 0, [0]
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return TreeAcceptance(path, [tokens[n] for n in path[1:]] + [best[node]])
        node = nxt
        path.append(node)


def tree_rejection_accept(
    tree: TokenTree,
    tokens: Sequence[int],
    probs: torch.Tensor,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> TreeAcceptance:
    """probs: [T, V] target distributions per node (after temperature/top-k/top-p);
    draft_probs: [T, V] the distribution each node was drawn from (row 0 unused), or None
    for deterministic nodes (one-hot q)."""
    kids = tree.children
    node, path = 0, [0]
    while True:
        residual = probs[node].double().clone()  # unnormalized: its sum is the mass left
        accepted = None
        for c in kids[node]:
            tok = tokens[c]
            mass = residual.sum()
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if draft_probs is None:  # one-hot q: accept with r(x)/|r|, else zero r(x)
                if mass > 0 and u * mass < residual[tok]:
                    accepted = c
                    break
                residual[tok] = 0.0
                continue
            q = draft_probs[c].double()
            # accept iff u < (r(x)/|r|) / q(x), i.e. u * q(x) * |r| < r(x)
            if mass > 0 and u * q[tok] * mass < residual[tok]:
                accepted = c
                break
            if mass > 0:
                residual = (residual / mass - q).clamp_min(0.0)
        if accepted is None:
            if residual.sum() <= 0:  # float corner: fall back to the target itself
                residual = probs[node].double()
            final = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
            return TreeAcceptance(path, [tokens[n] for n in path[1:]] + [final])
        node = accepted
        path.append(node)


def tree_typical_accept(
    tree: TokenTree,
    tokens: Sequence[int],
    probs: torch.Tensor,
    posterior_threshold: float,
    posterior_alpha: float,
    generator: torch.Generator | None,
) -> TreeAcceptance:
    """Medusa's typical acceptance (lossy). probs: [T, V]."""
    kids = tree.children
    node, path = 0, [0]
    while True:
        p = probs[node]
        entropy = -(p * torch.log(p.clamp_min(1e-10))).sum()
        bar = min(posterior_threshold, posterior_alpha * float(torch.exp(-entropy)))
        ok = [c for c in kids[node] if float(p[tokens[c]]) > bar]
        if not ok:
            final = int(torch.multinomial(p, 1, generator=generator))
            return TreeAcceptance(path, [tokens[n] for n in path[1:]] + [final])
        node = max(ok, key=lambda c: float(p[tokens[c]]))
        path.append(node)
