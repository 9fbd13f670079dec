"""The pieces of one speculative step, shared by the local engine and the coordinator.

    plan = plan_proposals(batch, capacity)        # who drafts, how many tokens
    parts = {m: proposer[m].propose(rows) ...}    # local call or remote ObjectRef
    draft, has_probs = merge_drafts(batch, plan, parts, vocab)
    logits = target.forward(slots, verify_tokens(batch, draft), logits_window(draft))
    result = accept(batch, draft, has_probs, logits)
    commit = commit_step(batch, draft, result, capacity, tokenizer)

``commit_step`` updates the requests and says what the target's cache lengths and each
proposer's rollbacks must become; the caller applies them to its (local or remote)
workers. Nothing here touches a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from specray.engine.request import TREE_METHODS, Request, RequestOutput
from specray.engine.scheduler import PLAIN
from specray.engine.verify import (  # noqa: F401 (re-exported)
    StepResult, TargetScores, accept, sampled_rows, sampling_tensors, tree_inputs,
)
from specray.kernels.sampling import probs_from_logits, sample
from specray.policies.base import Draft, ProposalRow, SamplingView
from specray.policies.spec_length import SpeculationLengthPolicy


@dataclass(frozen=True)
class ProposalPlan:
    """ks[i]: draft tokens row i may take; rows[method]: (batch indices, ProposalRows)."""

    ks: list[int]
    rows: dict[str, tuple[list[int], list[ProposalRow]]]


def plan_proposals(
    batch: Sequence[Request], capacity: int, policy: SpeculationLengthPolicy | None = None
) -> ProposalPlan:
    ks, rows = [], {}
    cap = policy.cap(len(batch)) if policy is not None else None
    for i, r in enumerate(batch):
        # Never draft past max_tokens or the context: k <= remaining - 1, and the target
        # must fit the last token + k drafts.
        k = max(0, min(r.remaining - 1, capacity - r.num_tokens))
        if r.speculation.method not in TREE_METHODS:
            k = min(k, r.speculation.num_speculative_tokens)
        if cap is not None:
            k = min(k, cap)
        ks.append(k)
        if r.speculation.method != PLAIN and k > 0:
            idx, lst = rows.setdefault(r.speculation.method, ([], []))
            idx.append(i)
            lst.append(proposal_row(r, k))
    return ProposalPlan(ks, rows)


def proposal_row(r: Request, k: int) -> ProposalRow:
    s = r.sampling
    return ProposalRow(
        slot=r.slot,
        token_ids=r.token_ids,
        num_tokens=k,
        sampling=SamplingView(s.temperature, s.top_p, s.effective_top_k),
        generator=r.generator,
        options={
            "max_matching_ngram_size": r.speculation.max_matching_ngram_size,
            "medusa_choices": r.speculation.medusa_choices,
            "tree": r.speculation.tree,
        },
        hidden=r.last_hidden,
    )


def merge_drafts(
    batch: Sequence[Request], plan: ProposalPlan, parts: Mapping[str, Draft | None], vocab_size: int
) -> tuple[Draft, list[bool]]:
    """One Draft [B, K] for the batch from each method's part (None = proposer failed)."""
    token_lists: list[list[int]] = [[] for _ in batch]
    probs_rows: dict[int, torch.Tensor] = {}
    trees: list = [None] * len(batch)
    for method, (idx, _) in plan.rows.items():
        part = parts.get(method)
        if part is None:
            continue  # that proposer is down: its rows decode plainly this step
        for n, i in enumerate(idx):
            if part.trees is not None and part.trees[n] is not None:  # a tree keeps all its nodes
                trees[i] = part.trees[n]
                token_lists[i] = part.tokens[n, : int(part.lengths[n])].tolist()
                continue
            length = min(int(part.lengths[n]), plan.ks[i])
            token_lists[i] = part.tokens[n, :length].tolist()
            if part.probs is not None and not batch[i].sampling.greedy:
                probs_rows[i] = part.probs[n, :length]
    draft = Draft.from_lists(token_lists)
    has_probs = [i in probs_rows for i in range(len(batch))]
    probs = None
    if probs_rows:
        probs = torch.zeros(len(batch), draft.max_len, vocab_size)
        for i, p in probs_rows.items():
            probs[i, : p.shape[0]] = p[:, :vocab_size]
    tree_rows = trees if any(t is not None for t in trees) else None
    return Draft(draft.tokens, draft.lengths, probs, trees=tree_rows), has_probs


def verify_tokens(batch: Sequence[Request], draft: Draft) -> list[list[int]]:
    """Per row: the last committed token (not yet in the target's cache) + its draft."""
    return [[r.output_ids[-1]] + draft.tokens[i, : int(draft.lengths[i])].tolist() for i, r in enumerate(batch)]


def logits_window(batch_size: int, draft: Draft) -> torch.Tensor:  # [B, K+1]
    return torch.arange(draft.max_len + 1)[None].expand(batch_size, -1)


@dataclass
class Commit:
    """What the workers must do after a step, and what the step produced.

    target_lengths: (slot, length) to roll the target back to; target_paths: (slot,
    kept tree nodes) to compact after that (tree rows).
    """

    target_lengths: list[tuple[int, int]] = field(default_factory=list)
    target_paths: list[tuple[int, list[int]]] = field(default_factory=list)
    proposer_commits: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    outputs: list[RequestOutput] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


def commit_step(
    batch: Sequence[Request], draft: Draft, result: StepResult, capacity: int, tokenizer, hidden=None
) -> Commit:
    """hidden: [B, K+1, H] target hidden states of the verify positions (methods that need them)."""
    commit = Commit()
    for i, r in enumerate(batch):
        n = result.num_accepted[i]
        drafted = int(draft.lengths[i])
        if i in result.paths:  # tree: keep the root + accepted path, compacted after the root
            commit.target_lengths.append((r.slot, r.num_tokens - 1))
            commit.target_paths.append((r.slot, result.paths[i]))
        else:  # the cache now holds the last committed token + the n accepted drafts
            commit.target_lengths.append((r.slot, r.num_tokens + n))
        if hidden is not None and r.needs_hidden:
            r.last_hidden = hidden[i, result.hidden_at[i]]
        if drafted:
            slots, counts = commit.proposer_commits.setdefault(r.speculation.method, ([], []))
            slots.append(r.slot)
            counts.append(n)
        r.metrics.record_draft(drafted, n)
        r.metrics.target_forward_passes += 1
        kept = r.append(result.emitted[i], capacity, tokenizer)
        commit.outputs.append(r.output(kept))
        if r.finished:
            commit.finished.append(r)
    return commit


def first_tokens(reqs: Sequence[Request], scores: TargetScores) -> list[int]:
    """Each admitted request's first token, from the target's scores at its last prompt token."""
    tokens = [row[0] for row in scores.best]
    if scores.sampled:
        probs = scores.probs(reqs)[:, 0]
        for i, tok in zip(scores.sampled, sample(probs, [reqs[i].generator for i in scores.sampled]).tolist()):
            tokens[i] = tok
    return tokens


def commit_prefill(reqs: Sequence[Request], tokens: Sequence[int], capacity: int, tokenizer, hidden=None) -> Commit:
    """hidden: [B, H] target hidden states at the last prompt token."""
    commit = Commit()
    for i, (r, tok) in enumerate(zip(reqs, tokens)):
        if hidden is not None and r.needs_hidden:
            r.last_hidden = hidden[i]
        r.metrics.target_forward_passes += 1
        kept = r.append([tok], capacity, tokenizer)
        commit.outputs.append(r.output(kept))
        if r.finished:
            commit.finished.append(r)
    return commit
