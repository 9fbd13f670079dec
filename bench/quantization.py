"""FP8 weights on the demo pair: the bytes each model holds, and what decoding costs and accepts,
unquantized and with ``--quantization fp8`` (target and draft).

    python -m specray.bench.quantization [--dtypes float32,bfloat16] [--batch 1,8] [--max-tokens 64]

Bytes: every parameter and buffer of the loaded model, and its linear layers alone (what FP8
stores: 1 byte a weight plus a float32 scale per output row; the LM head and embeddings stay in
the compute dtype). Decoding: plain and draft k=4, greedy, held-out prompts, one torch thread,
the fastest of ``--repeats`` runs in the process's CPU seconds (shared machines). Mismatches
count draft rows against plain decoding of the same weights (FP8 against FP8): must be 0, and
the exit code says so. On CPU the weight-only path dequantizes every layer at every step, so
FP8 is about memory here, not speed. Writes a JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from specray.bench import announce, demo_options

SPECS = {"plain": {"method": "none"}, "draft k=4": {"method": "draft", "num_speculative_tokens": 4}}


def byte_rows(pair, dtypes: list[str]) -> list[dict]:
    from specray.engine.quantization import weight_bytes
    from specray.engine.runner import load_model

    rows = []
    for role, path in (("target", pair.target), ("draft", pair.draft)):
        for dtype in dtypes:
            for quantization in (None, "fp8"):
                linear, total = weight_bytes(load_model(path, dtype, "cpu", quantization))
                rows.append({"model": role, "dtype": dtype, "quantization": quantization or "none",
                             "linear_bytes": linear, "all_bytes": total})
    for r in rows:  # each against the same model in bfloat16 / float32, unquantized
        for ref in ("bfloat16", "float32"):
            base = next((b for b in rows if b["model"] == r["model"] and b["dtype"] == ref
                         and b["quantization"] == "none"), None)
            if base is not None:
                r[f"linear_x_{ref}"] = round(r["linear_bytes"] / base["linear_bytes"], 4)
                r[f"all_x_{ref}"] = round(r["all_bytes"] / base["all_bytes"], 4)
    return rows


def decode_rows(pair, dtypes: list[str], args) -> list[dict]:
    from specray.demo import held_out_prompts
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for dtype in dtypes:
        for quantization in (None, "fp8"):
            for batch in [int(b) for b in args.batch.split(",")]:
                engine = LLMEngine(EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer,
                                                max_num_seqs=batch, dtype=dtype, quantization=quantization,
                                                draft_quantization=quantization))
                prompts = [engine.tokenizer.encode(t, add_special_tokens=False)
                           for t in held_out_prompts(max(args.prompts, batch), pair.tokenizer)]
                best, kept = {s: float("inf") for s in SPECS}, {}
                for _ in range(args.repeats):
                    for name, spec in SPECS.items():
                        before = engine.totals.to_dict()
                        began = time.process_time()
                        outs = engine.generate(prompts, sampling, SpeculationParams(**spec))
                        seconds = time.process_time() - began
                        if seconds < best[name]:
                            after = engine.totals.to_dict()
                            best[name] = seconds
                            kept[name] = (outs, {k: after[k] - before[k] for k in ("num_drafts", "num_accepted_tokens")})
                plain = [o.token_ids for o in kept["plain"][0]]
                for name, seconds in best.items():
                    outs, m = kept[name]
                    rows.append({
                        "dtype": dtype, "quantization": quantization or "none", "batch": batch, "method": name,
                        "tokens_per_cpu_s": round(sum(len(o.token_ids) for o in outs) / seconds, 1),
                        "mean_accepted_length": round(1 + m["num_accepted_tokens"] / m["num_drafts"], 3)
                        if m["num_drafts"] else 1.0,
                        "mismatches_vs_plain": sum(o.token_ids != r for o, r in zip(outs, plain)),
                    })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.quantization", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes (the bytes table); decoding runs "
                   "the first (CPU bfloat16 matmuls are slow)")
    p.add_argument("--no-decode", action="store_true", help="the bytes table only")
    demo_options(p, max_tokens=64)
    args = p.parse_args(argv)

    from transformers.utils import logging as hf_logging

    from specray.demo import load_or_build_demo_pair

    hf_logging.disable_progress_bar()
    command = announce("quantization", argv)
    pair = load_or_build_demo_pair()
    dtypes = args.dtypes.split(",")
    sizes = byte_rows(pair, dtypes)
    lines = [f"{'model':<7} {'dtype':<9} {'quant':<5} {'linear MiB':>10} {'all MiB':>8} {'lin x bf16':>10} "
             f"{'all x bf16':>10} {'all x fp32':>10}"]
    lines += [f"{r['model']:<7} {r['dtype']:<9} {r['quantization']:<5} {r['linear_bytes'] / 2**20:>10.3f} "
              f"{r['all_bytes'] / 2**20:>8.3f} {r.get('linear_x_bfloat16', float('nan')):>10.3f} "
              f"{r.get('all_x_bfloat16', float('nan')):>10.3f} {r.get('all_x_float32', float('nan')):>10.3f}"
              for r in sizes]
    print("\n".join(lines))
    decoding = [] if args.no_decode else decode_rows(pair, dtypes[:1], args)
    if decoding:
        lines = [f"{'dtype':<9} {'quant':<5} {'batch':>5} {'method':<10} {'tok/cpu-s':>9} {'acc.len':>8} {'mism':>5}"]
        lines += [f"{r['dtype']:<9} {r['quantization']:<5} {r['batch']:>5} {r['method']:<10} "
                  f"{r['tokens_per_cpu_s']:>9.1f} {r['mean_accepted_length']:>8.3f} {r['mismatches_vs_plain']:>5}"
                  for r in decoding]
        print("\n".join(lines))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quantization.json").write_text(json.dumps({"command": command, "bytes": sizes, "decoding": decoding},
                                                      indent=2))
    return 0 if all(r["mismatches_vs_plain"] == 0 for r in decoding) else 1


if __name__ == "__main__":
    sys.exit(main())
