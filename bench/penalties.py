"""What vLLM's penalties cost a speculative step, on the demo pair.

    python -m specray.bench.penalties [--modes eager,static] [--batch 1,8] [--max-tokens 64]

Plain decoding and draft k=4, each with no logit processing and with repetition, presence
and frequency penalties (``engine/logits.py``: every verified node processed with its own
history), greedy, held-out prompts, one torch thread, configs interleaved, the fastest of
``--repeats`` runs kept, timed in the process's CPU seconds (the machines this runs on are
shared). Prints tokens per CPU second, the penalised run over the unpenalised one, the mean
accepted length, and mismatches of each penalised draft run against penalised plain decoding
(must be 0: the exit code says so). Writes a JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from specray.bench import announce, demo_options

PENALTIES = {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.4}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.penalties", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="eager,static", help="step modes (eager, static, compile, ...)")
    demo_options(p, max_tokens=64)
    args = p.parse_args(argv)

    from specray.demo import held_out_prompts, load_or_build_demo_pair
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams

    command = announce("penalties", argv)
    pair = load_or_build_demo_pair()
    specs = {"plain": SpeculationParams(method="none"), "draft k=4": SpeculationParams(method="draft",
                                                                                        num_speculative_tokens=4)}
    samplings = {"": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True),
                 " +penalties": SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, **PENALTIES)}
    rows = []
    for mode in args.modes.split(","):
        for batch in [int(b) for b in args.batch.split(",")]:
            engine = LLMEngine(EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer,
                                            max_num_seqs=batch, step=mode))
            prompts = [engine.tokenizer.encode(t, add_special_tokens=False)
                       for t in held_out_prompts(max(args.prompts, batch), pair.tokenizer)]
            runs = {(s, k): (spec, sampling) for s, spec in specs.items() for k, sampling in samplings.items()}
            for spec, sampling in runs.values():  # warm-up (compiles, first allocations)
                engine.generate(prompts[:batch], sampling.model_copy(update={"max_tokens": 8}), spec)
            best, kept = {key: float("inf") for key in runs}, {}
            for _ in range(args.repeats):
                for key, (spec, sampling) in runs.items():
                    before = engine.totals.to_dict()
                    began = time.process_time()  # CPU seconds of this process: shared machines
                    outs = engine.generate(prompts, sampling, spec)
                    seconds = time.process_time() - began
                    if seconds < best[key]:
                        after = engine.totals.to_dict()
                        best[key] = seconds
                        kept[key] = (outs, {k: after[k] - before[k] for k in ("num_drafts", "num_accepted_tokens")})
            for (s, k), seconds in best.items():
                outs, m = kept[(s, k)]
                reference = [o.token_ids for o in kept[("plain", k)][0]]
                tps = sum(len(o.token_ids) for o in outs) / seconds
                unprocessed = sum(len(o.token_ids) for o in kept[(s, "")][0]) / best[(s, "")]
                rows.append({
                    "mode": mode, "batch": batch, "config": s + k, "tokens_per_cpu_s": round(tps, 1),
                    "x_unpenalised": round(tps / unprocessed, 3),
                    "mean_accepted_length": round(1 + m["num_accepted_tokens"] / m["num_drafts"], 3)
                    if m["num_drafts"] else 1.0,
                    "mismatches_vs_plain": sum(o.token_ids != r for o, r in zip(outs, reference)),
                })
    lines = [f"{'mode':>7} {'batch':>5} {'config':<24} {'tok/cpu-s':>9} {'x unpen.':>8} {'acc.len':>8} {'mism':>5}"]
    lines += [f"{r['mode']:>7} {r['batch']:>5} {r['config']:<24} {r['tokens_per_cpu_s']:>9.1f} {r['x_unpenalised']:>8.3f} "
              f"{r['mean_accepted_length']:>8.3f} {r['mismatches_vs_plain']:>5}" for r in rows]
    print("\n".join(lines))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "penalties.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    return 0 if all(r["mismatches_vs_plain"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
