"""Acceptance for a mixed batch: greedy rows by token match, sampled rows by rejection.

Both rules are lossless; rows are grouped only because they need different inputs
(argmax of logits vs. processed target probabilities and, when the proposer sampled,
its draft probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specray.kernels.acceptance import greedy_accept, rejection_accept
from specray.kernels.sampling import probs_from_logits
from specray.kernels.tree_acceptance import tree_greedy_accept, tree_rejection_accept, tree_typical_accept
from specray.policies.base import Draft


@dataclass(frozen=True)
class StepResult:
    """Per row: accepted count, emitted tokens, the verify position whose hidden state
    produced the final token, and (tree rows) the kept node path, root first."""

    num_accepted: list[int]
    emitted: list[list[int]]
    hidden_at: list[int]
    paths: dict[int, list[int]]


def tree_inputs(draft: Draft) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mask [B, q, q] bool, depth [B, q]) when any row is a tree; chains elsewhere."""
    if not draft.trees or all(t is None for t in draft.trees):
        return None
    b, q = draft.tokens.shape[0], draft.max_len + 1
    mask = torch.eye(q, dtype=torch.bool).repeat(b, 1, 1)  # padding nodes see themselves
    depth = torch.arange(q).repeat(b, 1)
    for i, tree in enumerate(draft.trees):
        if tree is None:
            n = int(draft.lengths[i]) + 1
            mask[i, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        else:
            mask[i, : tree.size, : tree.size] = tree.mask
            depth[i, : tree.size] = tree.depth
    return mask, depth


def sampling_tensors(reqs: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [N], top_k [N], top_p [N]) of sampled requests."""
    return (
        torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32),
        torch.tensor([r.sampling.effective_top_k for r in reqs], dtype=torch.long),
        torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32),
    )


def accept(reqs: Sequence, draft: Draft, has_probs: Sequence[bool], logits: torch.Tensor) -> StepResult:
    """logits: [B, K+1, V] target logits at the last committed token and each draft token."""
    b, k1, vocab = logits.shape
    if not draft.trees and all(r.sampling.greedy for r in reqs):
        return _accept_greedy_fast(draft, logits)
    num_accepted = torch.zeros(b, dtype=torch.long)
    tokens = torch.zeros(b, k1, dtype=torch.long)
    groups = {"greedy": [], "probs": [], "onehot": []}
    trees = draft.trees or [None] * b
    for i, r in enumerate(reqs):
        if trees[i] is not None:
            continue
        key = "greedy" if r.sampling.greedy else ("probs" if has_probs[i] else "onehot")
        groups[key].append(i)
    for key, idx in groups.items():
        if not idx:
            continue
        at = torch.tensor(idx)
        d_tokens, d_lens = draft.tokens[at], draft.lengths[at]
        if key == "greedy":
            part = greedy_accept(d_tokens, d_lens, logits[at])
        else:
            sub = [reqs[i] for i in idx]
            temperature, top_k, top_p = sampling_tensors(sub)
            flat = logits[at].reshape(-1, vocab)  # [n*(K+1), V]
            probs = probs_from_logits(
                flat, temperature.repeat_interleave(k1), top_k.repeat_interleave(k1), top_p.repeat_interleave(k1)
            ).view(len(idx), k1, vocab)
            d_probs = draft.probs[at] if key == "probs" else None
            part = rejection_accept(d_tokens, d_lens, d_probs, probs, [r.generator for r in sub])
        num_accepted[at] = part.num_accepted.cpu()
        tokens[at] = part.tokens.cpu()
    accepted = num_accepted.tolist()
    emitted = [tokens[i, : accepted[i] + 1].tolist() for i in range(b)]
    hidden_at = list(accepted)  # linear rows: position n produced the final token
    paths = {}
    for i, tree in enumerate(trees):
        if tree is not None:
            res = _accept_tree(reqs[i], tree, draft, i, logits[i, : tree.size])
            accepted[i], emitted[i], hidden_at[i], paths[i] = res.num_accepted, res.emitted, res.path[-1], res.path
    return StepResult(accepted, emitted, hidden_at, paths)


def _accept_greedy_fast(draft: Draft, logits: torch.Tensor) -> StepResult:
    """All rows greedy and linear (the common case): one argmax, then plain Python.

    Same rule as ``greedy_accept``; the step is dominated by host overhead at small
    batches, and this avoids a dozen small tensor ops.
    """
    best = logits.argmax(dim=-1).tolist()  # [B][K+1]
    drafts, lengths = draft.tokens.tolist(), draft.lengths.tolist()
    accepted, emitted = [], []
    for row_best, row_draft, n_draft in zip(best, drafts, lengths):
        n = 0
        while n < n_draft and row_draft[n] == row_best[n]:
            n += 1
        accepted.append(n)
        emitted.append(row_draft[:n] + [row_best[n]])
    return StepResult(accepted, emitted, list(accepted), {})


def _accept_tree(req, tree, draft: Draft, row: int, logits: torch.Tensor):  # logits [T, V]
    node_tokens = [int(req.output_ids[-1])] + draft.tokens[row, : tree.size - 1].tolist()
    s, spec = req.sampling, req.speculation
    if s.greedy:
        return tree_greedy_accept(tree, node_tokens, logits)
    n = tree.size
    probs = probs_from_logits(
        logits,
        torch.full((n,), s.temperature),
        torch.full((n,), s.effective_top_k, dtype=torch.long),
        torch.full((n,), s.top_p),
    )
    if spec.acceptance == "typical":
        return tree_typical_accept(tree, node_tokens, probs, False, spec.posterior_threshold,
                                   spec.posterior_alpha, req.generator)
    return tree_rejection_accept(tree, node_tokens, probs, req.generator)
