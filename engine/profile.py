"""The verification budget's cost table, measured at start-up (``policies/costs.py``).

Before it serves, the engine runs a few steps at each shape it may run — every batch-size
bucket up to ``max_num_seqs``, rows verifying 1 to ``max_k`` + 1 tokens — and each loaded
drafter at the smallest and largest bucket, shallow and deep, and records each step's
seconds in the table: so the budget prices a shape it has not served yet from a measurement,
not a guess, and needs no exploration. Each shape runs at least three steps (the table keeps their
median: a cold shape's first step, a compile or a lazy allocation, does not set its price).
Prompt lookup over a repeating prompt drafts the verification shapes (it always has a
continuation, and drafting costs it next to nothing); a draft model, a head or a block
drafter drafts its own shapes. Nothing of it stays: no totals, no acceptance, no taps.
"""

from __future__ import annotations

import logging
import time

from specray.engine.metrics import SpecMetrics
from specray.policies.budget import StepRecord, VerificationBudget
from specray.policies.costs import bucket, profile_widths

log = logging.getLogger(__name__)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8] * 3  # token ids every vocabulary has; repeating, so prompt lookup drafts
STEPS = 3  # speculative steps per shape


class _Forced:
    """Every row drafts ``k``; each step's costs (not its acceptance) go into ``budget``."""

    def __init__(self, budget: VerificationBudget, k: int):
        self.budget, self.k = budget, k

    def caps(self, rows):
        return [self.k] * len(rows)

    def observe(self, step: StepRecord) -> None:
        self.budget.observe_costs(step)

    def release(self, request_id: str) -> None:
        pass


def profile_costs(engine, budget: VerificationBudget) -> float:
    """Fill ``budget``'s cost table from steps run at each shape; returns the seconds it took."""
    from specray.engine.params import SamplingParams
    from specray.policies.registry import parse_speculation

    start = time.perf_counter()
    methods = [m for m in engine.limits.methods if m != "none"]
    top = bucket(engine.config.max_num_seqs) if engine.config.max_num_seqs > 1 else 1
    buckets = [b for b in (1 << i for i in range(top.bit_length())) if b <= engine.config.max_num_seqs]
    widths = profile_widths(budget.config.max_k)  # (the table interpolates between them)
    longest = STEPS + budget.config.max_k + 1  # tokens a row generates: STEPS steps of k whatever is accepted
    fits = engine.capacity - longest - budget.config.max_k - 1  # the prompt, and the last step's draft
    if fits < 4:  # a context too short to profile in: the table fills from served steps
        return 0.0
    prompt = [t % engine.limits.vocab_size for t in PROMPT[:fits]]
    plan = []
    if "ngram" in methods:
        plan += [("ngram", b, k) for b in buckets for k in widths]
    for m in methods:
        if m not in ("ngram", "suffix", "lookahead"):  # drafters with forwards of their own
            plan += [(m, b, k) for b in sorted({buckets[0], buckets[-1]}) for k in sorted({1, budget.config.max_k})]
    policy, taps = engine.driver.length_policy, engine.executor.taps
    engine.executor.taps = []
    try:
        for method, b, k in plan:
            engine.driver.length_policy = _Forced(budget, k)
            params = SamplingParams(max_tokens=STEPS + k + 1, temperature=0, ignore_eos=True)
            engine.generate([prompt] * b, params, parse_speculation({"method": method}))
    finally:
        engine.driver.length_policy, engine.executor.taps = policy, taps
        engine.scheduler.totals = SpecMetrics()
        engine.driver.phase_seconds = {"propose": 0.0, "verify": 0.0, "steps": 0}
    seconds = time.perf_counter() - start
    log.info("profiled %d step shapes in %.1f s", len(plan), seconds)
    return seconds
