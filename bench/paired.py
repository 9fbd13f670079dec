"""Engines run side by side, step by step: a CPU-time comparison that this machine's drift
does not decide.

On a shared VM a whole run's speed moves by tens of percent within seconds, so two configs run
one after the other (even interleaved run by run, the median of many rounds) differ by more
than the few percent a comparison such as "the self-tuned default against plain decoding at
batch 8" is about. Here each config has an engine of its own, every engine is given the same
requests, and the engines take turns a step at a time, the one least far through its tokens
stepping next: every moment of the machine's drift falls on all of them at the same point of
their work. Each engine's steps are timed in this process's CPU seconds. Two plain engines
compared this way agree within about 1% (the bench prints that check beside its results).
"""

from __future__ import annotations

import time
from typing import Sequence


def empty_prefix_cache(engine) -> None:
    """Drop the engine's cached prefixes before a run (between runs nothing is in it)."""
    if not engine.reset_prefix_cache():
        raise RuntimeError("requests were left in the engine between runs")


def side_by_side(sides: Sequence[tuple], prompts: Sequence[str], sampling: Sequence) -> list[dict]:
    """Run ``prompts`` through every side, ``(engine, speculation, length_policy[, sampling])``,
    steps interleaved by progress; ``sampling`` (or the side's own) and each side's
    ``speculation``: each prompt's parameters. Per side: CPU ``seconds`` of its steps, generated
    ``tokens``, target ``forwards`` (prefills included), the grammar drafter's ``forced`` and
    ``forced_accepted`` tokens, and the token ``ids`` of each prompt's completion, in prompt
    order. Each side starts from an empty prefix cache (the prompts may have run before)."""
    runs = []
    for engine, speculation, policy, *own in sides:
        empty_prefix_cache(engine)
        engine.driver.length_policy = policy
        params = own[0] if own else sampling
        ids = [engine.add_request(p, s, spec) for p, s, spec in zip(prompts, params, speculation, strict=True)]
        runs.append({"engine": engine, "ids": ids, "made": {}, "done": {}, "seconds": 0.0})
    live = list(runs)
    while live:
        run = min(live, key=lambda r: sum(r["made"].values()))  # the one least far through its work
        start = time.process_time()
        outputs = run["engine"].step()
        run["seconds"] += time.process_time() - start
        for out in outputs:
            run["made"][out.request_id] = len(out.token_ids)
            if out.finished:
                run["done"][out.request_id] = out
        if len(run["done"]) == len(run["ids"]):
            live.remove(run)
    return [{"seconds": r["seconds"], "tokens": sum(len(r["done"][i].token_ids) for i in r["ids"]),
             "forwards": _total(r, "target_forward_passes"), "forced": _total(r, "grammar_forced_tokens"),
             "forced_accepted": _total(r, "grammar_forced_accepted"),
             "ids": [r["done"][i].token_ids for i in r["ids"]]} for r in runs]


def _total(run: dict, name: str) -> int:
    return sum(run["done"][i].metrics.get(name) or 0 for i in run["ids"])
