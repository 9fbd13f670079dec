"""Block drafters on the demo pair: PARD against the draft model, each at its best k, DFlash
against EAGLE (EAGLE-1 trees), EAGLE-2 (dynamic trees) and EAGLE-3, each at its best setting,
and DSpark against DFlash, at batch 1 and 8.

    specray train pard --out PARD; specray train dflash --out DFLASH; specray train dspark --out DSPARK
    specray train eagle --out EAGLE; specray train eagle3 --out EAGLE3     (the EAGLE family, optional)
    python -m specray.bench.block --pard PARD --dflash DFLASH --dspark DSPARK --eagle EAGLE --eagle3 EAGLE3 [--batch 1,8]

Every config runs greedy on held-out prompts as one continuous batch of the batch size, configs
interleaved and repeated, each keeping its fastest run (``bench/trees.py``'s ``measure``). Speed
is tokens per CPU second of the one-threaded process (``--clock cpu``, the default: other work
on shared cores inflates wall time, not this; ``--clock wall`` for a quiet machine). Each
family's sweep (draft and PARD over k, DFlash over k, EAGLE-1 over trees, EAGLE-2 over dynamic
tree sizes, EAGLE-3 over both) gives its best setting (most tokens/s); the summary compares
PARD's best with the draft model's (goal: >= 1.15x tokens/s at batch 1) and DFlash's with the
EAGLE family's (goal: accepted length >= 1.2x the best of EAGLE, EAGLE-2 and EAGLE-3 at their
best settings; also given against the longest accepted length any EAGLE setting reached), and
DSpark's with DFlash's (goal: accepted length >= 1.1x; with ``--budget`` also both with no k,
the verification budget choosing). With DSpark, batch 1 also reports its
per-position acceptance with and without its Markov head and its confidence head's calibration
(``bench/calibration.py``; dspark-slots.png). Writes block.txt/json/csv/png to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import time

from specray.bench import announce, calibration, demo_options
from specray.bench.trees import measure

PARD_GOAL, DFLASH_GOAL, DSPARK_GOAL = 1.15, 1.2, 1.1
BUDGET_GOALS = (1.1, 1.0)  # DSpark under the budget: over DFlash under it, over plain (tok/s)


def configs(args, engine) -> dict[str, tuple[str, object]]:
    """Config name -> (family, speculation), plain first; every option explicit, so the
    self-tuning controller leaves it as is."""
    from specray.engine.params import SpeculationParams as S

    out = {"plain": ("plain", S(method="none"))}
    for k in args.draft_k:
        out[f"draft k={k}"] = ("draft model", S(method="draft", num_speculative_tokens=k))
    if args.pard:
        most = engine.limits.methods["pard"].get("max_tokens") or max(args.pard_k)
        for k in [k for k in args.pard_k if k <= most]:
            out[f"pard k={k}"] = ("PARD", S(method="pard", num_speculative_tokens=k))
    if args.dflash:
        block = engine.limits.methods["dflash"]["block_size"]
        for k in sorted({min(k, block - 1) for k in args.dflash_k}):
            out[f"dflash k={k}"] = ("DFlash", S(method="dflash", num_speculative_tokens=k))
    if args.dspark:
        most = engine.limits.methods["dspark"]["max_tokens"]
        for k in sorted({min(k, most) for k in args.dflash_k}):
            out[f"dspark k={k}"] = ("DSpark", S(method="dspark", num_speculative_tokens=k))
    if args.budget:  # no k: the verification budget sizes every row's draft each step
        for method, name in (("dflash", "DFlash"), ("dspark", "DSpark")):
            if getattr(args, method):
                out[f"{method} budget"] = (f"{name}+budget", S(method=method))
    for method, name in (("eagle", "EAGLE"), ("eagle3", "EAGLE-3")):
        if not getattr(args, method):
            continue
        head = engine.resources[method]
        fitted = {"eagle_choices": head.choices} if head.choices else {"tree": "mc_sim_7b_63"}
        out[f"{method} fitted tree"] = (name, S(method=method, **fitted))
        out[f"{method} mc_sim_7b_63"] = (name, S(method=method, tree="mc_sim_7b_63"))
        dynamic = "EAGLE-2" if method == "eagle" else "EAGLE-3"
        for opts in map(json.loads, args.eagle2):
            out[f"{method} dyn " + ",".join(f"{k}={v}" for k, v in opts.items())] = (
                dynamic, S(method=method, dynamic_tree=True, **opts))
    return out


def best_of(rows: list[dict], family: str, batch: int, by: str = "tokens_per_s") -> dict | None:
    sel = [r for r in rows if r["family"] == family and r["batch"] == batch]
    return max(sel, key=lambda r: r[by]) if sel else None


def versus(rows: list[dict], batch: int, mine: str, other: str, by: str, goal: float | None, goals: dict) -> str | None:
    """One family's best against another's at a batch size, compared ``by`` a row's key (its
    ratio recorded in ``goals``); None unless both ran."""
    a, b = best_of(rows, mine, batch), best_of(rows, other, batch)
    if not (a and b):
        return None
    ratio = a[by] / b[by]
    goals[f"{mine.lower()}_over_{other.split()[0].lower()}_batch{batch}"] = round(ratio, 3)
    what = "tok/s" if by == "tokens_per_s" else "acc.len"
    verdict = f" (goal >= {goal}x: {'met' if ratio >= goal else 'missed'})" if goal else ""
    return (f"batch {batch}: {mine} best {a['config']} {a['tokens_per_s']:.1f} tok/s, acc.len "
            f"{a['mean_accepted_length']:.2f} | {other} best {b['config']} {b['tokens_per_s']:.1f} tok/s, acc.len "
            f"{b['mean_accepted_length']:.2f} | {mine}/{other.split()[0]} {ratio:.2f}x {what}{verdict}"
            + (f", {a['tokens_per_s'] / b['tokens_per_s']:.2f}x tok/s" if by != "tokens_per_s" else "")
            + (f"; {mine} drafted nothing (plain decoding)" if a["tokens_verified_per_step"] <= 1 else ""))


def summary(rows: list[dict]) -> tuple[list[str], dict]:
    lines, goals = [""], {}
    for batch in sorted({r["batch"] for r in rows}):
        for mine, other, by, goal in (("PARD", "draft model", "tokens_per_s", PARD_GOAL if batch == 1 else None),
                                      ("DSpark", "DFlash", "mean_accepted_length", DSPARK_GOAL),
                                      ("DSpark+budget", "DFlash+budget", "tokens_per_s", BUDGET_GOALS[0]),
                                      ("DSpark+budget", "plain", "tokens_per_s", BUDGET_GOALS[1])):
            line = versus(rows, batch, mine, other, by, goal, goals)
            if line:
                lines.append(line)
        dflash = best_of(rows, "DFlash", batch)
        family = [best_of(rows, f, batch) for f in ("EAGLE", "EAGLE-2", "EAGLE-3")]
        family = [r for r in family if r]
        if dflash and family:
            top = max(family, key=lambda r: r["mean_accepted_length"])
            longest = max((r for r in rows if r["batch"] == batch and r["family"] in ("EAGLE", "EAGLE-2", "EAGLE-3")),
                          key=lambda r: r["mean_accepted_length"])
            ratio = dflash["mean_accepted_length"] / top["mean_accepted_length"]
            goals[f"dflash_over_eagle_family_batch{batch}"] = round(ratio, 3)
            for r in family:
                lines.append(f"batch {batch}: {r['family']:<8} best {r['config']:<36} {r['tokens_per_s']:7.1f} tok/s, "
                             f"acc.len {r['mean_accepted_length']:.2f} (verifies {r['tokens_verified_per_step']:.1f})")
            lines.append(f"batch {batch}: DFlash   best {dflash['config']:<36} {dflash['tokens_per_s']:7.1f} tok/s, "
                         f"acc.len {dflash['mean_accepted_length']:.2f} | over the EAGLE family's best "
                         f"({top['config']}): {ratio:.2f}x acc.len (goal >= {DFLASH_GOAL}x: "
                         f"{'met' if ratio >= DFLASH_GOAL else 'missed'}), "
                         f"{dflash['tokens_per_s'] / max(r['tokens_per_s'] for r in family):.2f}x tok/s; over the "
                         f"longest any EAGLE setting reached ({longest['config']}, {longest['mean_accepted_length']:.2f}):"
                         f" {dflash['mean_accepted_length'] / longest['mean_accepted_length']:.2f}x")
    return lines, goals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.block", description=__doc__.split("\n\n")[0])
    p.add_argument("--pard", default=None, help="PARD model dir (specray train pard --out ...)")
    p.add_argument("--dflash", default=None, help="DFlash drafter dir (specray train dflash --out ...)")
    p.add_argument("--eagle", default=None, help="EAGLE head dir (specray train eagle --out ...)")
    p.add_argument("--eagle3", default=None, help="EAGLE-3 head dir (specray train eagle3 --out ...)")
    p.add_argument("--dspark", default=None, help="DSpark drafter dir (specray train dspark --out ...): also its "
                                                  "per-position acceptance with and without its Markov head and "
                                                  "its confidence head's calibration")
    p.add_argument("--budget", action="store_true", help="also DFlash and DSpark with no k (the verification "
                                                         "budget chooses; goals for DSpark: >= 1.1x DFlash's "
                                                         "tok/s under it, >= 1.0x plain)")
    p.add_argument("--draft-k", type=lambda s: [int(k) for k in s.split(",")], default=[2, 3, 4, 5, 6])
    p.add_argument("--pard-k", type=lambda s: [int(k) for k in s.split(",")], default=[2, 3, 4, 5, 6, 7])
    p.add_argument("--dflash-k", type=lambda s: [int(k) for k in s.split(",")], default=[3, 5, 7, 11, 15])
    p.add_argument("--eagle2", action="append", default=None,
                   help='EAGLE-2 dynamic-tree settings (EAGLE and EAGLE-3 heads) as JSON (default: the options\' '
                        'defaults and {"top_k": 4, "depth": 7, "total_tokens": 32})')
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    demo_options(p, max_tokens=128)
    args = p.parse_args(argv)
    args.eagle2 = args.eagle2 or ['{"top_k": 8, "depth": 5, "total_tokens": 24}',
                                  '{"top_k": 4, "depth": 7, "total_tokens": 32}']

    from specray.demo import held_out_prompts, load_or_build_demo_pair
    from specray.engine import EngineConfig, LLMEngine, SamplingParams

    command = announce("block", argv)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    pair = load_or_build_demo_pair()
    checkpoints = {k: v for k, v in (("pard", args.pard), ("dflash", args.dflash), ("eagle", args.eagle),
                                     ("eagle3", args.eagle3), ("dspark", args.dspark)) if v}
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows, slots = [], None
    for batch in [int(b) for b in args.batch.split(",")]:
        engine = LLMEngine(EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer,
                                        checkpoints=checkpoints, max_num_seqs=batch))
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False)
                   for t in held_out_prompts(max(args.prompts, batch), pair.tokenizer)]
        named = configs(args, engine)
        measured = measure(engine, {n: s for n, (_, s) in named.items()}, prompts, sampling, args.repeats, batch,
                           clock)
        rows += [{"family": named[r["config"]][0], **r} for r in measured]
        if args.dspark and batch == 1:  # per position and calibration: the longest block, greedy
            k = max(s.num_speculative_tokens for family, s in named.values() if family == "DSpark")
            slots = calibration.measure_slots(engine, prompts, sampling,
                                              named[f"dspark k={k}"][1])
    lines, goals = summary(rows)
    if slots is not None:
        lines += calibration.lines(slots)
        goals["dspark_slots"] = slots
        pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
        calibration.plot(slots, pathlib.Path(args.out) / "dspark-slots.png")
    _report(rows, lines, goals, pathlib.Path(args.out), command, args.clock)
    return 0 if all(r["mismatches_vs_plain"] == 0 for r in rows) else 1


def _report(rows: list[dict], summary_lines: list[str], goals: dict, out: pathlib.Path, command: str,
            clock: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    unit = "tok/cpu-s" if clock == "cpu" else "tok/s"
    header = (f"{'batch':>5} {'family':<12} {'config':<36} {unit:>9} {'x plain':>8} {'acc.len':>8} {'verified':>8} "
              f"{'ms/step':>8} {'draft ms':>8} {'verify ms':>9} {'mism':>5}")
    lines = [header] + [
        f"{r['batch']:>5} {r['family']:<12} {r['config']:<36} {r['tokens_per_s']:>9.1f} {r['x_plain']:>8.3f} "
        f"{r['mean_accepted_length']:>8.3f} {r['tokens_verified_per_step']:>8.2f} {r['ms_per_step']:>8.3f} "
        f"{r['draft_ms_per_step']:>8.3f} {r['verify_ms_per_step']:>9.3f} {r['mismatches_vs_plain']:>5}"
        for r in rows
    ] + summary_lines
    print("\n".join(lines))
    (out / "block.txt").write_text(command + "\n" + "\n".join(lines) + "\n")
    (out / "block.json").write_text(json.dumps({"command": command, "clock": clock, "goals": goals, "rows": rows},
                                               indent=2))
    with open(out / "block.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(7 * len(batches), 8), squeeze=False)
    for col, b in enumerate(batches):
        sel = [r for r in rows if r["batch"] == b]
        for row, (key, title) in enumerate((("tokens_per_s", unit), ("mean_accepted_length", "accepted length/step"))):
            ax = axes[row][col]
            ax.bar([r["config"] for r in sel], [r[key] for r in sel])
            ax.set_title(f"batch {b}: {title} (greedy, demo pair)")
            plt.setp(ax.get_xticklabels(), rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "block.png", dpi=120)
    print(f"wrote {out / 'block.csv'}, {out / 'block.json'}, {out / 'block.png'}")


if __name__ == "__main__":
    sys.exit(main())
