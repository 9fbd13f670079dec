"""The verification budget against fixed speculation settings and plain decoding, on the demo pair.

    python -m specray.bench.selftune [--methods draft,eagle3] [--batches 1,8,32] [--rounds 3]
                                     [--max-tokens 32] [--queue 2] [--mixed] [--recipe quick] [--out DIR]

What a user gets who names a method and no length (``{"method": "draft"}``: the budget chooses
per request and step, ``docs/speculation-length.md``) against the best fixed setting of the same
weights and against plain decoding, at each batch size. Per batch size B, ``--queue`` x
max(B, 8) held-out prompts of five lengths (0.5x to 1.5x ``--max-tokens``) go through B slots, greedy, EOS
ignored (a server under load: the batch stays full until the queue drains, requests ending apart).

1. **Sweep** (chosen beforehand, apart from the comparison): each fixed setting in ``SWEEP``
   for the method runs once beside plain decoding; the fastest is the *chosen fixed setting*.
2. **Comparison**, ``--rounds`` rounds: the default (one budget kept across the rounds after a
   first untimed run: a server that has served), the chosen fixed setting, and plain decoding
   (the measurement's own spread), each beside a plain decoding engine (``bench/paired.py``:
   steps interleaved, CPU seconds; the engines swap sides every round).

``--mixed``: half the requests easy for their drafter (suffix decoding on
prompts served before: suffix decoding's global tree holds their answers), half hard (the draft
model on held-out text) — two methods in one batch; the default against each single fixed k for
every row and plain.

Goals (issue: verification budgets): the default >= 0.95x the chosen fixed setting and >= 1.0x
plain at every batch size; on the mixed batch >= 1.1x the best single fixed setting where the
step verifies ragged — every step mode here pads rows to the widest (the docs say what a cut
buys there), so that goal is reported, not counted. Every config's tokens are checked against
plain decoding's. Exit code 1 where a goal is missed. Writes selftune.{txt,json,png} to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

from specray.bench import DEFAULT_OUT, announce

CHAIN = [{"num_speculative_tokens": k} for k in (1, 2, 4, 8)]
SWEEP = {
    "draft": CHAIN, "ngram": CHAIN, "suffix": CHAIN,
    "eagle": [{"tree": "chain"}, {"dynamic_tree": False}, {"dynamic_tree": True, "total_tokens": 8},
              {"dynamic_tree": True}],
    "eagle3": [{"tree": "chain"}, {"dynamic_tree": True, "total_tokens": 8}, {"dynamic_tree": True}],
    "medusa": [{"tree": "chain"}, {"tree": "trtllm_example"}, {"tree": "wide"}],
    "redrafter": [{"num_beams": b} for b in (1, 2, 4)],
}
HEADS = ("eagle", "eagle3", "medusa", "redrafter")
LENGTHS = (0.5, 1.5, 0.75, 1.25, 1.0)  # request lengths, x --max-tokens, in turn
GOAL_FIXED, GOAL_PLAIN, GOAL_MIXED = 0.95, 1.0, 1.1
HEADS_VERSION = "v3"  # of the cached heads: raise it when the recipes or what a head saves changes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.selftune", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="draft", help="comma-separated subset of " + ",".join(SWEEP))
    p.add_argument("--batches", default="1,8,32", help="batch sizes (slots), comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the comparison (medians and spreads)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--queue", type=int, default=2, metavar="X", help="X times the batch size (at least 8) of prompts per run")
    p.add_argument("--mixed", action="store_true", help="also the mixed batch (suffix decoding on easy rows, the draft model on hard ones)")
    p.add_argument("--recipe", choices=("readme", "quick"), default="quick",
                   help="how heads are trained (training/recipes.py), cached beside the demo pair")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    args = p.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m and m not in SWEEP]
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join(SWEEP)})")
    command = announce("selftune", argv)
    return _run(args, command)


def _engines(args, pair, batch: int, methods: list[str]):
    """Two engines (one a side) for ``batch`` slots, each with its cost table profiled."""
    from specray.demo.pair import default_cache_dir
    from specray.engine import EngineConfig, LLMEngine
    from specray.training.recipes import cached_heads

    name = f"{args.recipe}-heads-{HEADS_VERSION}-{pathlib.Path(pair.target).parent.name}"
    heads = cached_heads(pair.target, pair.tokenizer, str(default_cache_dir() / name),
                         [m for m in methods if m in HEADS], args.recipe)
    config = EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer, medusa=heads.get("medusa"),
                          checkpoints={m: d for m, d in heads.items() if m != "medusa"}, max_num_seqs=batch)
    return LLMEngine(config), LLMEngine(config)


def _run(args, command: str) -> int:
    from specray.demo import held_out_prompts, load_or_build_demo_pair
    from specray.engine import SamplingParams, SpeculationParams

    pair = load_or_build_demo_pair()
    methods = [m for m in args.methods.split(",") if m]
    results, lines, ok = [], [], True
    for batch in (int(b) for b in args.batches.split(",") if b):
        engines = _engines(args, pair, batch, methods)
        prompts = held_out_prompts(args.queue * max(batch, 8), pair.tokenizer)
        sampling = [SamplingParams(max_tokens=max(1, round(args.max_tokens * LENGTHS[i % len(LENGTHS)])),
                                   temperature=0, ignore_eos=True) for i in range(len(prompts))]
        bench = _Paired(engines, prompts, sampling)
        spread = bench.rounds(args.rounds, lambda _: [SpeculationParams(method="none")] * len(prompts))
        for m in methods:
            row = _method(bench, m, args.rounds, len(prompts))
            row.update(batch=batch, plain_spread=spread)
            ok &= row["goal_fixed"] and row["goal_plain"]
            results.append(row)
        if args.mixed:
            row = _mixed(bench, pair, batch, args)
            results.append(row)
    text = "\n".join(_table(results, args))
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selftune.txt").write_text(f"command: {command}\n{text}\n")
    (out / "selftune.json").write_text(json.dumps({"command": command, "rows": results}, indent=1))
    plot(results, out / "selftune.png")
    return 0 if ok else 1


class _Paired:
    """Configs run beside plain decoding (``paired.side_by_side``), each check against it."""

    def __init__(self, engines, prompts, sampling):
        from specray.policies.budget import VerificationBudget

        self.engines, self.prompts, self.sampling = engines, prompts, sampling
        self.budgets = [e.driver.length_policy for e in engines]  # each engine's profiled budget
        assert all(isinstance(b, VerificationBudget) for b in self.budgets)
        self.want = None
        self.round = 0

    def once(self, specs, policy=None) -> float:
        """One run of ``specs`` (one per prompt) beside plain decoding: plain's CPU seconds over
        the config's (the same tokens: its speed against plain). ``policy(side)``: the length
        policy the config's engine runs with (default: a fresh budget on that engine's table)."""
        from specray.bench.paired import side_by_side
        from specray.engine import SpeculationParams

        e = self.round % 2
        self.round += 1
        plain = [SpeculationParams(method="none")] * len(self.prompts)
        mine = policy(e) if policy is not None else self.budgets[e].fresh()
        base, run = side_by_side([(self.engines[1 - e], plain, self.budgets[1 - e].fresh()),
                                  (self.engines[e], specs, mine)], self.prompts, self.sampling)
        self.want = self.want or base["ids"]
        assert base["ids"] == self.want and run["ids"] == self.want, "output differs from plain decoding"
        return base["seconds"] / run["seconds"]

    def rounds(self, n: int, specs_for, policy=None) -> list[float]:
        return [round(self.once(specs_for(r), policy), 3) for r in range(n)]


def _summary(ratios: list[float]) -> dict:
    return {"median": round(statistics.median(ratios), 3), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def _method(bench: _Paired, method: str, rounds: int, n: int) -> dict:
    from specray.engine import SpeculationParams
    from specray.policies.registry import parse_speculation

    sweep = {}
    for setting in SWEEP[method]:
        try:
            parse_speculation({"method": method, **setting})
        except ValueError:
            continue
        sweep[json.dumps(setting)] = round(bench.once([SpeculationParams(method=method, **setting)] * n), 3)
    chosen = max(sweep, key=sweep.get)
    fixed = [SpeculationParams(method=method, **json.loads(chosen))] * n
    default = [SpeculationParams(method=method)] * n
    kept = [b.fresh() for b in bench.budgets]  # a server's budget per engine, kept across rounds
    bench.once(default, lambda e: kept[e])  # its first run: a server that has served before
    d = bench.rounds(rounds, lambda r: default, policy=lambda e: kept[e])
    f = bench.rounds(rounds, lambda r: fixed)
    row = {"method": method, "sweep": sweep, "chosen": chosen, "default": _summary(d), "fixed": _summary(f),
           "default_x_fixed": round(statistics.median(d) / statistics.median(f), 3)}
    row["goal_fixed"] = row["default_x_fixed"] >= GOAL_FIXED
    row["goal_plain"] = row["default"]["median"] >= GOAL_PLAIN
    return row


def _mixed(bench: _Paired, pair, batch: int, args) -> dict:
    """Half the rows suffix decoding on prompts served before (its global tree holds their
    answers: easy), half the draft model on held-out text (hard); the default against each
    single k for every row."""
    from specray.engine import SpeculationParams

    method = ["suffix" if i % 2 == 0 else "draft" for i in range(len(bench.prompts))]
    mixed = _Paired(bench.engines, bench.prompts, bench.sampling)
    for _ in bench.engines:  # each engine serves the prompts once: suffix's tree learns their answers
        mixed.once([SpeculationParams(method=m) for m in method])
    sweep = {k: round(mixed.once([SpeculationParams(method=m, num_speculative_tokens=k) for m in method]), 3)
             for k in (1, 2, 4, 8)}
    best = max(sweep, key=sweep.get)
    default = [SpeculationParams(method=m) for m in method]
    kept = [b.fresh() for b in bench.budgets]
    for e in range(len(bench.engines)):
        mixed.once(default, lambda side, e=e: kept[side])
    d = mixed.rounds(args.rounds, lambda r: default, policy=lambda e: kept[e])
    f = mixed.rounds(args.rounds, lambda r: [SpeculationParams(method=m, num_speculative_tokens=best) for m in method])
    return {"method": "mixed (suffix easy + draft hard)", "batch": batch, "sweep": sweep, "chosen": f"k={best}",
            "default": _summary(d), "fixed": _summary(f),
            "default_x_fixed": round(statistics.median(d) / statistics.median(f), 3), "ragged": False}


def _table(rows: list[dict], args) -> list[str]:
    lines = [f"the verification budget (default) vs the best fixed setting (a sweep beforehand) vs plain decoding, "
             f"demo pair, greedy; per batch B, {args.queue} x max(B, 8) prompts of {min(LENGTHS) * args.max_tokens:.0f}-"
             f"{max(LENGTHS) * args.max_tokens:.0f} tokens; x plain = plain's CPU s / the config's, side by side; "
             f"medians of {args.rounds} rounds [min-max]",
             f"{'batch':>5s} {'method':32s} {'chosen fixed':34s} {'default x plain':>22s} {'fixed x plain':>22s} "
             f"{'default/fixed':>13s}  goals (>= {GOAL_FIXED} fixed, >= {GOAL_PLAIN} plain)"]
    for r in rows:
        span = lambda s: f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"  # noqa: E731
        if "goal_fixed" in r:
            goals = f"{'met' if r['goal_fixed'] else 'MISSED'} / {'met' if r['goal_plain'] else 'MISSED'}"
        else:
            goals = f">= {GOAL_MIXED} fixed applies to ragged verification only (padded here)"
        lines.append(f"{r['batch']:5d} {r['method']:32s} {r['chosen']:34s} {span(r['default']):>22s} "
                     f"{span(r['fixed']):>22s} {r['default_x_fixed']:13.3f}  {goals}")
    lines.append("sweeps (x plain, one run each): " + "; ".join(
        f"B{r['batch']} {r['method'].split()[0]}: " + ", ".join(f"{k} {v}" for k, v in r["sweep"].items()) for r in rows))
    spreads = {r["batch"]: r["plain_spread"] for r in rows if "plain_spread" in r}
    lines.append("plain beside plain (the measurement's own spread): "
                 + "; ".join(f"B{b}: {' '.join(f'{x:.3f}' for x in s)}" for b, s in spreads.items()))
    return lines


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Speed against plain decoding per batch size and method: default and chosen fixed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * len(rows)), 3.4))
    x = range(len(rows))
    for offset, key, label in ((-0.2, "fixed", "best fixed setting"), (0.2, "default", "default (budget)")):
        med = [r[key]["median"] for r in rows]
        err = [[m - r[key]["min"] for m, r in zip(med, rows)], [r[key]["max"] - m for m, r in zip(med, rows)]]
        ax.bar([i + offset for i in x], med, 0.4, yerr=err, capsize=3, label=label)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="plain decoding")
    ax.set_xticks(list(x), [f"B{r['batch']}\n{r['method'].split()[0]}" for r in rows], fontsize=8)
    ax.set_ylabel("speed x plain (CPU s)")
    ax.set_title("verification budget vs best fixed setting, demo pair")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
