"""Lookahead decoding against plain decoding and prompt lookup, on the demo pair.

    python -m specray.bench.lookahead [--prompts 10] [--max-tokens 128] [--batches 1,8]
                                      [--configs 3:5:2,2:8:2,...] [--repeats 2]

Greedy, held-out prompts, ``torch.set_num_threads(1)``. At batch 1 every config runs each
prompt in turn (interleaved prompt by prompt); at batch B the prompts go in groups of B
through an engine of B slots (interleaved group by group). Each (config, prompt or group)
keeps its fastest of ``--repeats`` runs. Lookahead configs are ``W:N:G``; two ablations:
``W:N:G:nohist`` pools only the window's n-grams (not the committed tokens'), to show what
the Jacobi window finds by itself, and ``W:N:G:nowin`` runs no window (the verification
branch over the committed tokens' n-grams alone), to show what the window adds and costs.

Times are this process's CPU seconds (one torch thread, so on an idle machine about the wall
time, and far less disturbed by other work on a shared machine); tokens per wall-clock
second are reported beside them. Prints a table (tokens/s, x plain, mean accepted length,
tokens per target forward, ms per step, new tokens per step at most, and where a step's
time goes: the target forward, the proposer, the rest — acceptance, commits, bookkeeping),
checks every config's tokens against plain decoding, and a second table: the target
forward's cost against the number of new tokens per row (what a wider window or a larger G
costs). Writes CSV/JSON/PNG to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import time
from specray.bench import DEFAULT_OUT

DEFAULT_CONFIGS = "3:5:2,2:8:2,4:5:4,7:5:7,3:5:2:nohist,3:5:2:nowin"
ABLATIONS = {"nohist": {"history": False}, "nowin": {"window": False}}
CLOCK_NOTE = ("tok/s, ms/step, shares and forward costs count this process's CPU seconds (one torch thread: on an "
              "idle machine about its wall time, and much less disturbed by other work on a shared one); "
              "'wall' is tokens per wall-clock second")
FORWARD_TOKENS = (1, 2, 4, 8, 16, 32)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.lookahead", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="lookahead W:N:G[:nohist|:nowin], comma-separated")
    p.add_argument("--ngram-k", type=int, default=6, help="prompt lookup's num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    args = p.parse_args(argv)

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv) -> int:
    from specray.demo import held_out_prompts, load_or_build_demo_pair
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams
    from specray.policies.lookahead import LookaheadProposer

    print("command: python -m specray.bench.lookahead " + " ".join(argv if argv is not None else sys.argv[1:]))
    pair = load_or_build_demo_pair()
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    configs = {"plain": SpeculationParams(method="none"),
               f"ngram k={args.ngram_k}": SpeculationParams(method="ngram", num_speculative_tokens=args.ngram_k)}
    ablation = {}  # config -> the ablation its lookahead proposer runs
    for item in args.configs.split(","):
        w, n, g, *flags = item.split(":")
        name = " ".join([f"lookahead {w}:{n}:{g}", *flags])
        configs[name] = SpeculationParams(method="lookahead", window_size=int(w), ngram_size=int(n),
                                          verification_set_size=int(g))
        if flags:
            ablation[name] = flags[0]

    rows, costs = [], []
    for batch in [int(b) for b in args.batches.split(",")]:
        config = EngineConfig(target=pair.target, tokenizer=pair.tokenizer, max_num_seqs=batch)
        # One engine per lookahead proposer variant (the same target weights each).
        engines = {None: LLMEngine(config)} | {
            flag: LLMEngine(config, proposers={"lookahead": lambda ctx, kw=kw: LookaheadProposer(**kw)})
            for flag, kw in ABLATIONS.items() if flag in ablation.values()}
        engine = engines[None]
        clocks = {flag: _clock(e) for flag, e in engines.items()}
        texts = held_out_prompts(args.prompts, pair.tokenizer)
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        best = {c: [float("inf")] * len(groups) for c in configs}  # CPU seconds of this process
        wall = {c: [float("inf")] * len(groups) for c in configs}
        split = {c: [None] * len(groups) for c in configs}  # (forward, propose) CPU seconds of the best run
        tokens: dict[str, list] = {c: [None] * len(groups) for c in configs}
        metrics: dict[str, list] = {c: [None] * len(groups) for c in configs}
        for e in engines.values():  # warm-up
            e.generate(groups[0], sampling, configs["plain"])
        for _ in range(args.repeats):
            for i, group in enumerate(groups):
                for name, spec in configs.items():
                    runner, clock = engines[ablation.get(name)], clocks[ablation.get(name)]
                    clock.update(forward=0.0, propose=0.0)
                    start, start_wall = time.process_time(), time.perf_counter()
                    outs = runner.generate(group, sampling, spec)
                    elapsed, elapsed_wall = time.process_time() - start, time.perf_counter() - start_wall
                    wall[name][i] = min(wall[name][i], elapsed_wall)
                    if elapsed < best[name][i]:
                        best[name][i], split[name][i] = elapsed, (clock["forward"], clock["propose"])
                    tokens[name][i], metrics[name][i] = [o.token_ids for o in outs], [o.metrics for o in outs]
        plain_tps = plain_wall = None
        for name, spec in configs.items():
            ms = [m for group in metrics[name] for m in group]
            total = sum(len(t) for group in tokens[name] for t in group)
            seconds = sum(best[name])
            tps, wall_tps = total / seconds, total / sum(wall[name])
            plain_tps, plain_wall = plain_tps or tps, plain_wall or wall_tps
            drafts = sum(m["num_drafts"] for m in ms)
            accepted = sum(m["num_accepted_tokens"] for m in ms)
            # Engine steps: each group's requests join together, so its longest-running one
            # took part in every step.
            steps = sum(max(m["target_forward_passes"] for m in group) for group in metrics[name])
            forward, propose = (sum(x[k] for x in split[name]) for k in (0, 1))
            rows.append({
                "batch": batch,
                "config": name,
                "tokens_per_cpu_s": round(tps, 1),
                "x_plain": round(tps / plain_tps, 3),
                "tokens_per_wall_s": round(wall_tps, 1),
                "x_plain_wall": round(wall_tps / plain_wall, 3),
                "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
                "tokens_per_target_forward": round(total / sum(m["target_forward_passes"] for m in ms), 3),
                "ms_per_step": round(1000 * seconds / steps, 3),
                "new_tokens_per_step": spec.tokens_per_step if spec.method == "lookahead" else "",
                "forward_share": round(forward / seconds, 3),
                "propose_share": round(propose / seconds, 3),
                "mismatches_vs_plain": sum(a != b for g, h in zip(tokens[name], tokens["plain"]) for a, b in zip(g, h)),
            })
        costs += [{"batch": batch, "new_tokens_per_row": q, "ms_per_forward": ms}
                  for q, ms in _forward_costs(engine.target, batch, FORWARD_TOKENS)]
    return _report(rows, costs, pathlib.Path(args.out))


def _clock(engine) -> dict:
    """Time the engine's target forwards (prefill + verify) and its proposers, per run."""
    clock = {"forward": 0.0, "propose": 0.0}
    executor = engine.executor

    def timed(fn, key):
        async def run(*args, **kwargs):
            start = time.process_time()
            try:
                return await fn(*args, **kwargs)
            finally:
                clock[key] += time.process_time() - start
        return run

    executor.prefill = timed(executor.prefill, "forward")
    executor.verify = timed(executor.verify, "forward")
    executor.propose = timed(executor.propose, "propose")
    return clock


def _forward_costs(runner, batch: int, qs, prefix: int = 200, repeats: int = 30) -> list[tuple[int, float]]:
    """Fastest target forward (ms) with q new tokens per row on a ``prefix``-token cache,
    every position scored (as a verification step is); the sizes take turns, so a burst of
    load on the machine does not land on one of them only."""
    import torch

    slots = list(range(batch))
    for s in slots:
        runner.reset(s)
    runner.forward(slots, [[5] * prefix] * batch)
    best = {q: float("inf") for q in qs}
    for _ in range(repeats):
        for q in qs:
            mask = torch.tril(torch.ones(q, q, dtype=torch.bool)).repeat(batch, 1, 1)
            layout = (mask, torch.arange(q).repeat(batch, 1))
            start = time.process_time()
            runner.forward(slots, [[7] * q] * batch, torch.arange(q)[None].expand(batch, -1), layout)
            best[q] = min(best[q], time.process_time() - start)
            for s in slots:
                runner.set_length(s, prefix)
    for s in slots:
        runner.reset(s)
    return [(q, round(1000 * t, 3)) for q, t in best.items()]


def _report(rows: list[dict], costs: list[dict], out: pathlib.Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{'batch':>5} {'config':<24} {'tok/s':>7} {'x plain':>8} {'wall':>7} {'x plain':>8} {'acc.len':>8} "
              f"{'tok/fwd':>8} {'ms/step':>8} {'new/step':>8} {'fwd %':>6} {'prop %':>6} {'mism':>5}")
    lines = [header] + [
        f"{r['batch']:>5} {r['config']:<24} {r['tokens_per_cpu_s']:>7.1f} {r['x_plain']:>8.3f} "
        f"{r['tokens_per_wall_s']:>7.1f} {r['x_plain_wall']:>8.3f} "
        f"{r['mean_accepted_length']:>8.3f} {r['tokens_per_target_forward']:>8.3f} {r['ms_per_step']:>8.3f} "
        f"{str(r['new_tokens_per_step']):>8} {100 * r['forward_share']:>6.1f} {100 * r['propose_share']:>6.1f} "
        f"{r['mismatches_vs_plain']:>5}"
        for r in rows
    ]
    batches = sorted({c["batch"] for c in costs})
    lines = [CLOCK_NOTE, ""] + lines
    lines += ["", "target forward, CPU ms, by new tokens per row (200 cached tokens, every position scored):",
              f"{'batch':>5} " + " ".join(f"{q:>7}" for q in FORWARD_TOKENS)]
    lines += [f"{b:>5} " + " ".join(f"{c['ms_per_forward']:>7.2f}" for c in costs if c["batch"] == b) for b in batches]
    print("\n".join(lines))
    (out / "lookahead.txt").write_text("\n".join(lines) + "\n")
    (out / "lookahead.json").write_text(json.dumps({"runs": rows, "forward_cost": costs}, indent=2))
    with open(out / "lookahead.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(5.5 * (len(batches) + 1), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        part = [r for r in rows if r["batch"] == batch]
        ax.bar([r["config"] for r in part], [r["x_plain"] for r in part])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("tokens per CPU second relative to plain")
        ax.set_title(f"batch {batch}, greedy")
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    ax = axes[0][-1]
    for b in batches:
        part = [c for c in costs if c["batch"] == b]
        ax.plot([c["new_tokens_per_row"] for c in part], [c["ms_per_forward"] for c in part], marker="o",
                label=f"batch {b}")
    ax.set_xlabel("new tokens per row")
    ax.set_ylabel("CPU ms per target forward")
    ax.set_title("what verified tokens cost (CPU)")
    ax.legend()
    fig.suptitle("specray on the demo pair: lookahead (W:N:G) vs plain and prompt lookup")
    fig.tight_layout()
    fig.savefig(out / "lookahead.png", dpi=120)
    return 0 if all(r["mismatches_vs_plain"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
