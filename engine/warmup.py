"""Compiling a compiled engine before it serves: every graph its loaded methods run.

Under ``step=compile`` each model compiles on its first forward (the target's, the draft
model's, each head's, the acceptance's): minutes on a small CPU. ``warm_up`` runs one short
request per loaded method that owns a compiled forward, plain decoding first, so a server
pays them while it starts (before it says ready) instead of a user's first request paying
them, and one plain request whose logits are processed (penalties): the target's graph
accepts inside itself, such rows accept in a graph of their own; a draft model also drafts
a sampled request and a longer one (its default k is a chain of forwards in one graph, greedy
or with sampled rows; a longer k drafts a forward at a time). Nothing of it stays: its
requests leave no totals, teach the speculation-length controller nothing (their steps'
seconds are compile times) and reach no step taps (online learning's capture). Torch's own caches (``TORCHINDUCTOR_CACHE_DIR``, by default under
``/tmp``: generated code, AOT graphs) make a restart's warm-up shorter where they still hold.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

from specray.engine.metrics import SpecMetrics
from specray.policies.spec_length import SpeculationLengthPolicy

log = logging.getLogger(__name__)

# Methods whose proposers compile forwards of their own; the others (n-gram, suffix,
# lookahead) run the target's graphs only.
COMPILED_METHODS = ("none", "draft", "medusa", "eagle", "eagle3", "redrafter")
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]  # token ids every vocabulary has


def warm_up(engine, max_tokens: int = 6) -> float:
    """Run one short greedy request per loaded method with compiled forwards, then forget
    it; returns the seconds it took."""
    from specray.engine.params import SamplingParams
    from specray.policies.registry import parse_speculation

    start = time.perf_counter()
    methods = [m for m in COMPILED_METHODS if m in engine.limits.methods]
    with unrecorded(engine, SpeculationLengthPolicy()):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompt = [t % engine.limits.vocab_size for t in PROMPT]
        for method in methods:
            engine.generate([prompt], params, parse_speculation({"method": method}))
        if "draft" in methods:  # its chains of forwards (greedy, sampled) and its one forward (a longer k)
            sampled = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
            engine.generate([prompt], sampled, parse_speculation({"method": "draft"}))
            longer = parse_speculation({"method": "draft"})
            longer = parse_speculation({"method": "draft", "num_speculative_tokens": longer.num_speculative_tokens + 1})
            engine.generate([prompt], SamplingParams(max_tokens=max_tokens + 2, temperature=0, ignore_eos=True), longer)
        if methods:  # rows that process their logits (penalties) accept in a graph of their own
            penalized = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, repetition_penalty=1.1)
            engine.generate([prompt], penalized, parse_speculation({"method": "none"}))
    seconds = time.perf_counter() - start
    log.info("compiled the step for %s in %.1f s", ", ".join(methods), seconds)
    return seconds


@contextmanager
def unrecorded(engine, policy):
    """Run requests on ``engine`` that leave nothing behind: ``policy`` decides their lengths
    (the engine's own learns nothing from them), no step tap (online learning's capture) sees
    them, and the totals and phase times are reset after."""
    saved, taps = engine.driver.length_policy, engine.executor.taps
    engine.driver.length_policy, engine.executor.taps = policy, []
    try:
        yield
    finally:
        engine.driver.length_policy, engine.executor.taps = saved, taps
        engine.scheduler.totals = SpecMetrics()
        engine.driver.phase_seconds = {"propose": 0.0, "verify": 0.0, "steps": 0}
