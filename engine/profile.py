"""The verification budget's cost table, measured at start-up (``policies/costs.py``).

Before it serves, the engine runs a few steps at each shape it may run — every batch-size
bucket up to ``max_num_seqs``, rows verifying 1 to ``max_k`` + 1 tokens — and each loaded
drafter at the smallest and largest bucket at caps of 1, 2, 4, ... ``max_k`` slots (a tree drafter
also whole), each at a short
and a long context (``CONTEXTS`` tokens a row: the table interpolates between them), and records each step's
seconds in the table: so the budget prices a shape it has not served yet from a measurement,
not a guess. Each shape runs at least three steps (the table keeps their
median: a cold shape's first step, a compile or a lazy allocation, does not set its price).
The verification shapes are drafted as prompt lookup's rows (its proposer swapped for one
that drafts the row's last token k times: every row drafts exactly k, at no cost, as prompt
lookup's drafting costs next to nothing); a draft model, a head or a block drafter drafts its
own shapes. Nothing of it stays: no totals, no acceptance, no taps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import nullcontext

from specray.engine.warmup import PROMPT as TOKENS, unrecorded
from specray.policies.base import Draft, DraftRow
from specray.policies.budget import StepRecord, VerificationBudget
from specray.policies.costs import profile_widths

log = logging.getLogger(__name__)

PROMPT = TOKENS * 3  # token ids every vocabulary has
STEPS = 3  # speculative steps per shape
CONTEXTS = (len(PROMPT), 256)
"""Tokens a row holds in the profile's steps: a short prompt's, and a few hundred (what a
chat's turn holds); the table is linear in context between them and beyond."""


class _Repeat:
    """Drafts each row's last token ``num_tokens`` times: shapes to verify, at no drafting cost."""

    def propose(self, rows):
        return Draft([DraftRow([r.token_ids[-1]] * r.num_tokens) for r in rows])

    def commit(self, rows) -> None:
        pass

    def release(self, slot: int) -> None:
        pass


class _Forced:
    """Every row drafts ``k``; each step's costs (not its acceptance) go into ``budget``, at
    the profile's nominal ``context``."""

    def __init__(self, budget: VerificationBudget, k: int, context: int):
        self.budget, self.k, self.context = budget, k, context

    def caps(self, rows, context=None, forced=None):
        return [self.k] * len(rows)

    def observe(self, step: StepRecord) -> None:
        self.budget.observe_costs(dataclasses.replace(step, context=self.context), profiled=True)

    def release(self, request_id: str) -> None:
        pass


def profile_costs(engine, budget: VerificationBudget) -> float:
    """Fill ``budget``'s cost table from steps run at each shape; returns the seconds it took."""
    from specray.engine.params import SamplingParams
    from specray.policies.registry import method_spec, parse_speculation

    start = time.perf_counter()
    max_k, most = budget.config.max_k, engine.config.max_num_seqs
    fits = engine.capacity - STEPS * (max_k + 1) - 1 - max_k  # the prompt, the tokens a row may make, a draft
    if fits < 4:  # a context too short to profile in: the table fills from served steps
        return 0.0
    contexts = sorted({min(c, fits) for c in CONTEXTS})
    buckets = [1 << i for i in range(most.bit_length())]  # 1, 2, 4, ... up to max_num_seqs
    plan = [("ngram", b, k) for b in buckets for k in profile_widths(max_k)] if "ngram" in engine.limits.methods else []
    for m in engine.limits.methods:
        spec = method_spec(m)
        if spec.checkpoint:  # drafters with weights: forwards of their own at caps 1, 2, 4, ... (a tree: and whole)
            caps = profile_widths(max_k)[1:] + ([None] if spec.drafts_trees else [])
            plan += [(m, b, k) for b in sorted({1, buckets[-1]}) for k in caps]
    plan = [(method, b, k, c) for method, b, k in plan for c in contexts]
    for method, b, k, context in plan:
        # the prefill, then STEPS steps of k drafts a row (the table keeps their median)
        prompt = [t % engine.limits.vocab_size for t in (PROMPT * (context // len(PROMPT) + 1))[:context]]
        params = SamplingParams(max_tokens=STEPS * ((k or max_k) + 1) + 1, temperature=0, ignore_eos=True)
        drafter = engine.proposers.swapped("ngram", _Repeat()) if method == "ngram" else nullcontext()
        with unrecorded(engine, _Forced(budget, k, context)), drafter:
            ids = [engine.add_request(prompt, params, parse_speculation({"method": method})) for _ in range(b)]
            for _ in range(STEPS + 1):
                engine.step()
            for i in ids:
                engine.abort(i)
    seconds = time.perf_counter() - start
    log.info("profiled %d step shapes in %.1f s", len(plan), seconds)
    return seconds
