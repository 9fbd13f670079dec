"""The pure pieces of one speculative step (no models, no devices): the driver
(``engine/driver.py``) calls them in order.

    plan    = plan_proposals(batch, capacity, policy)   # who drafts, at most how many nodes
    drafts  = merge_drafts(batch, plan, parts)          # one DraftRow per row
    inputs  = verify_inputs(batch, drafts)              # tokens, layout, scored positions
    verified = executor.verify(batch, drafts)           # target + acceptance (engine/accept.py,
                                                        # or engine/device_step.py on the device)
    commit  = commit_step(batch, verified, ...)         # requests advance; what workers must do

``Commit`` says what the target keeps (a path per row: one mechanism for chains, trees and
windows), what each proposer is told (``CommitRow``/``PrefillRow``; the executor that ran
the target adds the features for methods that need them) and which requests finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from specray.engine.request import Request, RequestOutput, speculation_event
from specray.engine import logprobs as L
from specray.engine.accept import TargetScores, Verified
from specray.engine.grammar import ForcedRow
from specray.policies.base import EMPTY, CommitRow, DeviceDraft, Draft, DraftRow, PrefillRow, ProposalRow, SamplingView
from specray.policies.budget import RowView
from specray.policies.registry import PLAIN, method_spec


@dataclass(frozen=True)
class ProposalPlan:
    """ks[i]: draft nodes row i may have accepted; rows[method]: (batch indices, ProposalRows)."""

    ks: list[int]
    rows: dict[str, tuple[list[int], list[ProposalRow]]]


def row_view(r: Request) -> RowView:
    """What the speculation-length policy sees of a row (made once: a request's speculation
    options never change)."""
    if r.row_view is None:
        r.row_view = _row_view(r)
    return r.row_view


def _row_view(r: Request) -> RowView:
    options, spec = r.speculation, method_spec(r.method)
    tree = spec.drafts_trees
    given = options.model_fields_set - {"method"}
    fixed = bool(given) if tree else "num_speculative_tokens" in given
    # A seeded sampled request drafts its method's default length every step: which draws its
    # generator serves depends on the drafts, so a length chosen from timings would make the
    # same seed give different text.
    fixed = fixed or (r.sampling.seed is not None and not r.sampling.greedy)
    return RowView(r.request_id, r.method, options.budget, fixed, tree, spec.block, spec.confidence)


def plan_proposals(batch: Sequence[Request], capacity: int, sizes: Sequence[int | None] | None = None) -> ProposalPlan:
    """sizes[i]: the speculation size the policy gives row i (None: the method's own, a tree)."""
    ks, rows = [], {}
    for i, r in enumerate(batch):
        # Never draft past max_tokens or the context: at most remaining - 1 accepted nodes,
        # and the target must fit the root + the nodes it verifies.
        room = capacity - r.num_tokens
        k = max(0, min(r.remaining - 1, room))
        size = sizes[i] if sizes is not None else r.speculation.budget
        if size is not None:
            k = min(k, size)
        ks.append(k)
        if r.method != PLAIN and k > 0:
            idx, lst = rows.setdefault(r.method, ([], []))
            idx.append(i)
            lst.append(proposal_row(r, k, room))
    return ProposalPlan(ks, rows)


def proposal_row(r: Request, k: int, room: int) -> ProposalRow:
    s = r.sampling
    return ProposalRow(
        slot=r.slot,
        token_ids=r.token_ids,
        num_tokens=k,
        sampling=SamplingView(s.temperature, s.top_p, s.effective_top_k),
        generator=r.generator,
        options=r.speculation,
        width=room,
        seed=s.seed,
    )


def merge_drafts(batch: Sequence[Request], plan: ProposalPlan, parts: Mapping[str, Draft | None]) -> list[DraftRow]:
    """One DraftRow per batch row from each method's part (None = that proposer is down:
    its rows decode plainly this step). Chains are cut to the plan; trees come cut by their
    proposer; greedy rows drop draft probabilities (token match does not read them). A
    structured output's deterministic chain is cut at its first token the grammar refuses."""
    drafts = [EMPTY] * len(batch)
    for method, (idx, _) in plan.rows.items():
        part = parts.get(method)
        if part is None:
            continue
        on_host = not isinstance(part, DeviceDraft)  # a device draft's tokens are placeholders until read back
        for row, i in zip(part.rows, idx):
            row = row.cut(plan.ks[i])
            if row.probs is not None and batch[i].sampling.greedy:
                row = DraftRow(row.tokens, row.tree, None, row.extra, row.confidence)
            if on_host and batch[i].grammar is not None:
                row = _grammar_cut(batch[i], row)
            drafts[i] = row
    return drafts


def device_rows(plan: ProposalPlan, parts: Mapping[str, Draft | None]) -> set[int]:
    """Batch rows whose draft was made on the device (its tokens are read back after verifying)."""
    return {i for method, part in parts.items() if isinstance(part, DeviceDraft) for i in plan.rows[method][0]}


def _grammar_cut(r: Request, row: DraftRow) -> DraftRow:
    """A chain drafted deterministically (or verified greedily) up to its first token the
    grammar refuses: that node could never be accepted (the masked target gives it no mass,
    and with a one-hot q its rejection draws from the masked target itself, as the step
    after a shorter draft does). A sampled drafter's chain is left whole: its refused token is
    a rejection against the q it was drawn from."""
    if not row.is_chain or row.extra is not None or row.probs is not None or not row.tokens:
        return row
    n = r.grammar.valid_prefix(row.tokens)
    if n < row.size:
        r.metrics.grammar_cut_tokens = (r.metrics.grammar_cut_tokens or 0) + row.size - n
        return row.cut(n)
    return row


@dataclass(frozen=True)
class VerifyInput:
    """What the target runs: per row the root + its nodes (+ extra nodes).

    tokens:    [B][q_i] new tokens per row
    layout:    (mask [B, q, q] bool, offsets [B, q]) when any row is not a chain, else None
    """

    tokens: list[list[int]]
    layout: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def logits_at(self) -> torch.Tensor:
        """[B, q] every new position is scored (acceptance walks any of them): the eager
        forward's; made when read, as the fixed-shape step scores every position anyway."""
        return torch.arange(max(map(len, self.tokens)))[None].expand(len(self.tokens), -1)


def verify_inputs(batch: Sequence[Request], drafts: Sequence[DraftRow]) -> VerifyInput:
    tokens = []
    for r, d in zip(batch, drafts):
        row = [r.output_ids[-1]] + d.tokens
        if d.extra is not None:
            row += d.extra.tokens
        tokens.append(row)
    q = max(map(len, tokens))
    layout = None
    if any(not d.is_chain or d.extra is not None for d in drafts):
        mask = torch.eye(q, dtype=torch.bool).repeat(len(batch), 1, 1)  # padding nodes see themselves
        offsets = torch.arange(q).repeat(len(batch), 1)
        for i, d in enumerate(drafts):
            t = d.structure
            mask[i, : t.size, : t.size] = t.mask
            offsets[i, : t.size] = t.depth
            if d.extra is not None:
                width = t.size + len(d.extra.tokens)
                mask[i, t.size : width, :width] = d.extra.sees
                offsets[i, t.size : width] = torch.tensor(d.extra.positions)
        layout = (mask, offsets)
    return VerifyInput(tokens, layout)


@dataclass
class Commit:
    """What the workers must do after a step, and what the step produced.

    target_keep:  (slot, base, path): roll the target back to base, keep the path's nodes
    proposer_rows: method -> [(batch index, CommitRow | PrefillRow)]; the executor that ran
                  the target fills in features for methods that need them
    """

    target_keep: list[tuple[int, int, list[int]]] = field(default_factory=list)
    proposer_rows: dict[str, list[tuple[int, CommitRow | PrefillRow]]] = field(default_factory=dict)
    outputs: list[RequestOutput] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


def commit_step(batch: Sequence[Request], verified: Verified, capacity: int, tokenizer) -> Commit:
    """verified: the acceptance, the drafts as verified and the target's argmax at extra nodes."""
    commit = Commit()
    result, drafts = verified.result, verified.drafts
    for i, r in enumerate(batch):
        n, path, d = result.num_accepted[i], result.paths[i], drafts[i]
        # The cache holds the root (at num_tokens - 1) and every verified node after it.
        commit.target_keep.append((r.slot, r.num_tokens - 1, path))
        if r.method != PLAIN:  # also when it drafted nothing: feature methods track every step
            commit.proposer_rows.setdefault(r.method, []).append(
                (i, CommitRow(r.slot, result.emitted[i], path, extra_best=verified.extra_best[i])))
        r.metrics.record_draft(d.size, n, forced=isinstance(d, ForcedRow))
        r.metrics.target_forward_passes += 1
        kept = r.append(result.emitted[i], capacity, tokenizer, verified.logprobs[i] if verified.logprobs else None)
        line, rejected = main_line(d, path)
        commit.outputs.append(r.output(kept, speculation_event(r.method, line, rejected, n, kept, d.size)))
        if r.finished:
            commit.finished.append(r)
    return commit


def main_line(draft: DraftRow, path: list[int]) -> tuple[list[int], list[int]]:
    """(the draft's main line, its rejected tail): the accepted path, then the first-ranked
    child chain below its last node (for a chain: the whole draft, and what follows n)."""
    if draft.is_chain:
        return draft.tokens, draft.tokens[len(path) - 1 :]
    kids, node, tail = draft.tree.children, path[-1], []
    while kids[node]:
        node = kids[node][0]
        tail.append(draft.tokens[node - 1])
    return [draft.tokens[p - 1] for p in path[1:]] + tail, tail


def commit_prefill(reqs: Sequence[Request], tokens: Sequence[int | None], capacity: int, tokenizer,
                   scores: TargetScores | None = None) -> Commit:
    """The first token of each admitted request (its prompt is now in the target's cache); a
    resumed request (token None) keeps its last emitted token as the root and emits nothing.
    scores: the prefill's, for requests that asked for log-probabilities."""
    commit = Commit()
    for i, (r, tok) in enumerate(zip(reqs, tokens)):
        if tok is None:
            if r.method != PLAIN:
                row = PrefillRow(r.slot, r.prefill_ids, r.output_ids[-1])
                commit.proposer_rows.setdefault(r.method, []).append((i, row))
            continue
        if r.method != PLAIN:
            commit.proposer_rows.setdefault(r.method, []).append((i, PrefillRow(r.slot, r.prompt_ids, tok)))
        r.metrics.target_forward_passes += 1
        first = None
        if scores is not None and i in scores.scored:
            first = L.entries(scores.scored[i][:1], [tok], r.sampling.logprobs)
        if scores is not None and i in scores.prompt_logprobs:
            r.prompt_logprobs = scores.prompt_logprobs[i]
        kept = r.append([tok], capacity, tokenizer, first)
        commit.outputs.append(r.output(kept, speculation_event(r.method, [], [], 0, kept, 0)))
        if r.finished:
            commit.finished.append(r)
    return commit
