"""Acceptance for a mixed batch: greedy rows by token match, sampled rows by rejection.

Both rules are lossless; rows are grouped only because they need different inputs
(the target's argmax ids vs. its processed probabilities and, when the proposer sampled,
the draft probabilities). ``TargetScores`` is the target's side reduced to exactly that,
built next to the model, so a remote target ships a few ints per greedy row instead of
[K+1, V] logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from specray.engine import logprobs as L
from specray.kernels.acceptance import greedy_accept, rejection_accept
from specray.kernels.sampling import probs_from_logits
from specray.kernels.tree_acceptance import tree_greedy_accept, tree_rejection_accept, tree_typical_accept
from specray.policies.base import Draft, DraftRow


@dataclass(frozen=True)
class StepResult:
    """Per row: accepted node count, emitted tokens (accepted nodes + the final token) and the
    kept path (node indices, root first; a chain's is 0..n)."""

    num_accepted: list[int]
    emitted: list[list[int]]
    paths: list[list[int]]


@dataclass(frozen=True)
class Verified:
    """A verified step as the driver commits it: the acceptance, the drafts as verified
    (rows drafted on the device carry their tokens again), and the target's argmax at each
    row's extra nodes (lookahead windows; None for rows without)."""

    result: StepResult
    drafts: list[DraftRow]
    extra_best: list[list[int] | None]
    logprobs: list[list[dict] | None] | None = None  # per row, its emitted tokens' (rows that asked)


@dataclass(frozen=True)
class TargetScores:
    """best: [B][m] argmax ids at every scored position; logits: [n, m, V] of the rows in
    ``sampled`` only (None when every row is greedy); scored: {row: [m, V]} logits of the
    rows that asked for log-probabilities (``engine/logprobs.py``); prompt_logprobs: {row:
    entries} of a prefill's rows that asked for their prompt's."""

    best: list[list[int]]
    sampled: list[int]
    logits: torch.Tensor | None
    scored: dict[int, torch.Tensor] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)

    @classmethod
    def from_logits(cls, logits: torch.Tensor, sampled: Sequence[int] = (), scored: Sequence[int] = (),
                    processed: torch.Tensor | None = None) -> "TargetScores":  # [B, m, V] each
        """processed: the logits as the rows sample from them (``engine/logits.py``; default the raw
        ones): argmax and sampling read those, log-probabilities the raw ones."""
        sampled = list(sampled)
        use = logits if processed is None else processed
        kept = use[torch.tensor(sampled, device=use.device)] if sampled else None
        return cls(use.argmax(dim=-1).tolist(), sampled, kept, {i: logits[i] for i in scored})

    def cpu(self) -> "TargetScores":
        """For sending across processes (a local engine keeps the logits on its device)."""
        return replace(self, logits=self.logits.cpu() if self.logits is not None else None,
                       scored={i: t.cpu() for i, t in self.scored.items()})

    def probs(self, reqs: Sequence) -> torch.Tensor | None:
        """[n, m, V] the sampled rows' target distributions (temperature/top-k/top-p applied),
        in ``sampled`` order; None when every row is greedy."""
        if not self.sampled:
            return None
        n, m, vocab = self.logits.shape
        return target_probs(self.logits, [reqs[i] for i in self.sampled]).view(n, m, vocab)


def sampled_rows(reqs: Sequence) -> list[int]:
    """Rows whose acceptance needs the target's full distribution."""
    return [i for i, r in enumerate(reqs) if not r.sampling.greedy]


def target_probs(logits: torch.Tensor, reqs: Sequence, check: bool = True) -> torch.Tensor:
    """logits: [n, m, V] of the sampled rows ``reqs`` [n] -> [n * m, V] their sampling
    distributions (temperature, min-p, top-k, top-p of each row at all its m positions)."""
    n, m, vocab = logits.shape
    temperature, top_k, top_p = (t.repeat_interleave(m) for t in sampling_tensors(reqs))
    min_p = None
    if any(r.sampling.min_p for r in reqs):
        min_p = torch.tensor([r.sampling.min_p for r in reqs], dtype=torch.float32).repeat_interleave(m)
    return probs_from_logits(logits.reshape(-1, vocab), temperature, top_k, top_p, check=check, min_p=min_p)


def sampling_tensors(reqs: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [N], top_k [N], top_p [N]) of sampled requests."""
    return (
        torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32),
        torch.tensor([r.sampling.effective_top_k for r in reqs], dtype=torch.long),
        torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32),
    )


def accept_verified(reqs: Sequence, drafts: Sequence[DraftRow], scores: TargetScores) -> Verified:
    """The host path: acceptance from the target's scores (the eager reference)."""
    extra_best = [scores.best[i][d.size + 1 : d.size + 1 + len(d.extra.tokens)] if d.extra is not None else None
                  for i, d in enumerate(drafts)]
    result = accept(reqs, drafts, scores)
    logprobs = L.step_entries(reqs, scores.scored, result.paths, result.emitted) if scores.scored else None
    return Verified(result, list(drafts), extra_best, logprobs)


def accept(reqs: Sequence, drafts: Sequence[DraftRow], scores: TargetScores) -> StepResult:
    """scores: the target at the root and at every node of each row."""
    b = len(reqs)
    accepted, emitted, paths = [0] * b, [[] for _ in range(b)], [[0]] * b
    chains = [i for i in range(b) if drafts[i].is_chain]
    greedy = [i for i in chains if reqs[i].sampling.greedy]
    if greedy:
        counts, tokens = greedy_accept([drafts[i].tokens for i in greedy], [scores.best[i] for i in greedy])
        for i, n, toks in zip(greedy, counts, tokens):
            accepted[i], emitted[i] = n, toks
    probs = scores.probs(reqs)  # one call for every sampled row, chain or tree
    where = {row: n for n, row in enumerate(scores.sampled)}
    groups = {"probs": [], "onehot": []}
    for i in chains:
        if not reqs[i].sampling.greedy:
            groups["probs" if drafts[i].probs is not None else "onehot"].append(i)
    for key, idx in groups.items():
        if not idx:
            continue
        part_draft = Draft([drafts[i] for i in idx])
        k = part_draft.max_len
        d_probs = part_draft.probs if key == "probs" else None
        part = rejection_accept(part_draft.tokens, part_draft.lengths, d_probs,
                                probs[[where[i] for i in idx], : k + 1], [reqs[i].generator for i in idx])
        for j, i in enumerate(idx):
            accepted[i], emitted[i] = int(part.num_accepted[j]), part.emitted(j)
    for i in chains:
        paths[i] = list(range(accepted[i] + 1))
    for i in range(b):
        if not drafts[i].is_chain:
            node_probs = probs[where[i], : drafts[i].size + 1] if i in where else None
            res = _accept_tree(reqs[i], drafts[i], scores.best[i][: drafts[i].size + 1], node_probs)
            accepted[i], emitted[i], paths[i] = res.num_accepted, res.emitted, res.path
    return StepResult(accepted, emitted, paths)


def _accept_tree(req, draft: DraftRow, best: list[int], probs: torch.Tensor | None):
    """best: [T] argmax per node; probs: [T, V] target distributions (sampled rows)."""
    tree = draft.tree
    node_tokens = [int(req.output_ids[-1])] + draft.tokens
    spec = req.speculation
    if req.sampling.greedy:
        return tree_greedy_accept(tree, node_tokens, best)
    if getattr(spec, "acceptance", "exact") == "typical":
        return tree_typical_accept(tree, node_tokens, probs, spec.posterior_threshold, spec.posterior_alpha,
                                   req.generator)
    q = None
    if draft.probs is not None:  # node i + 1 was drawn from draft.probs[i]; row 0 (root) unused
        q = torch.cat([torch.zeros_like(draft.probs[:1]), draft.probs]).to(probs.device)
    return tree_rejection_accept(tree, node_tokens, probs, req.generator, q)
