"""Acceptance for a mixed batch: greedy rows by token match, sampled rows by rejection.

Both rules are lossless; rows are grouped only because they need different inputs
(the target's argmax ids vs. its processed probabilities and, when the proposer sampled,
the draft probabilities). ``TargetScores`` is the target's side reduced to exactly that,
built next to the model, so a remote target ships a few ints per greedy row instead of
[K+1, V] logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class TargetScores:
    """best: [B][m] argmax ids at every scored position; logits: [n, m, V] of the rows in
    ``sampled`` only (None when every row is greedy)."""

    best: list[list[int]]
    sampled: list[int]
    logits: torch.Tensor | None

    @classmethod
    def from_logits(cls, logits: torch.Tensor, sampled: Sequence[int] = ()) -> "TargetScores":  # [B, m, V]
        sampled = list(sampled)
        kept = logits[torch.tensor(sampled, device=logits.device)] if sampled else None
        return cls(logits.argmax(dim=-1).tolist(), sampled, kept)

    def cpu(self) -> "TargetScores":
        """For sending across processes (a local engine keeps the logits on its device)."""
        return replace(self, logits=self.logits.cpu()) if self.logits is not None else self

    def probs(self, reqs: Sequence) -> torch.Tensor | None:
        """[n, m, V] the sampled rows' target distributions (temperature/top-k/top-p applied),
        in ``sampled`` order; None when every row is greedy."""
        if not self.sampled:
            return None
        n, m, vocab = self.logits.shape
        temperature, top_k, top_p = sampling_tensors([reqs[i] for i in self.sampled])
        flat = probs_from_logits(self.logits.reshape(-1, vocab), temperature.repeat_interleave(m),
                                 top_k.repeat_interleave(m), top_p.repeat_interleave(m))
        return flat.view(n, m, vocab)


def sampled_rows(reqs: Sequence) -> list[int]:
    """Rows whose acceptance needs the target's full distribution."""
    return [i for i, r in enumerate(reqs) if not r.sampling.greedy]


def sampling_tensors(reqs: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [N], top_k [N], top_p [N]) of sampled requests."""
    return (
        torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32),
        torch.tensor([r.sampling.effective_top_k for r in reqs], dtype=torch.long),
        torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32),
    )


def accept(reqs: Sequence, draft: Draft, has_probs: Sequence[bool], scores: TargetScores) -> StepResult:
    """scores: the target at the last committed token and each draft token ([B, K+1])."""
    b = len(reqs)
    trees = draft.trees or [None] * b
    drafts, lengths = draft.tokens.tolist(), draft.lengths.tolist()
    accepted, emitted = [0] * b, [[] for _ in range(b)]
    greedy = [i for i in range(b) if trees[i] is None and reqs[i].sampling.greedy]
    if greedy:
        counts, tokens = greedy_accept([drafts[i][: lengths[i]] for i in greedy], [scores.best[i] for i in greedy])
        for i, n, toks in zip(greedy, counts, tokens):
            accepted[i], emitted[i] = n, toks
    probs = scores.probs(reqs)  # one call for every sampled row, linear or tree
    where = {row: n for n, row in enumerate(scores.sampled)}
    groups = {"probs": [], "onehot": []}
    for i, r in enumerate(reqs):
        if trees[i] is None and not r.sampling.greedy:
            groups["probs" if has_probs[i] else "onehot"].append(i)
    for key, idx in groups.items():
        if not idx:
            continue
        at = torch.tensor(idx)
        d_probs = draft.probs[at] if key == "probs" else None
        part = rejection_accept(draft.tokens[at], draft.lengths[at], d_probs, probs[[where[i] for i in idx]],
                                [reqs[i].generator for i in idx])
        for j, i in enumerate(idx):
            accepted[i], emitted[i] = int(part.num_accepted[j]), part.emitted(j)
    hidden_at = list(accepted)  # linear rows: position n produced the final token
    paths = {}
    for i, tree in enumerate(trees):
        if tree is not None:
            node_probs = probs[where[i], : tree.size] if i in where else None
            res = _accept_tree(reqs[i], tree, draft, i, scores.best[i][: tree.size], node_probs)
            accepted[i], emitted[i], hidden_at[i], paths[i] = res.num_accepted, res.emitted, res.path[-1], res.path
    return StepResult(accepted, emitted, hidden_at, paths)


def _accept_tree(req, tree, draft: Draft, row: int, best: list[int], probs: torch.Tensor | None):
    """best: [T] argmax per node; probs: [T, V] target distributions (sampled rows)."""
    node_tokens = [int(req.output_ids[-1])] + draft.tokens[row, : tree.size - 1].tolist()
    spec = req.speculation
    if req.sampling.greedy:
        return tree_greedy_accept(tree, node_tokens, best)
    if spec.acceptance == "typical":
        return tree_typical_accept(tree, node_tokens, probs, spec.posterior_threshold, spec.posterior_alpha,
                                   req.generator)
    return tree_rejection_accept(tree, node_tokens, probs, req.generator)
