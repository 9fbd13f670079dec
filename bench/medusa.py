"""Medusa trees against plain decoding and draft-model speculation, on the demo pair.

    specray train medusa --out HEADS                       # once (a few CPU minutes)
    python -m specray.bench.medusa --heads HEADS [--prompts 10] [--max-tokens 128]

Batch 1, greedy, held-out prompts, ``torch.set_num_threads(1)``. Configs run interleaved
prompt by prompt and repeated; each (config, prompt) keeps its fastest time. Prints a table
(tokens/s, x plain, mean accepted length, tokens per target forward, ms per step, tree size),
checks every config's tokens against plain decoding, and writes CSV/JSON/PNG to --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.medusa", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="Medusa heads dir (specray train medusa --out ...)")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--draft-k", type=int, default=4)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    import torch

    from specray.demo import held_out_prompts, load_or_build_demo_pair
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams
    from specray.kernels.tree import NAMED_TREES
    from specray.policies.medusa import resolve_tree

    torch.set_num_threads(1)
    print("command: python -m specray.bench.medusa " + " ".join(argv if argv is not None else sys.argv[1:]))
    pair = load_or_build_demo_pair()
    engine = LLMEngine(EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer,
                                    medusa=args.heads, max_num_seqs=1))
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in held_out_prompts(args.prompts, pair.tokenizer)]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    configs = {"plain": SpeculationParams(method="none"),
               f"draft k={args.draft_k}": SpeculationParams(method="draft", num_speculative_tokens=args.draft_k)}
    configs.update({f"medusa {name}": SpeculationParams(method="medusa", tree=name) for name in NAMED_TREES})
    heads_tree = engine.medusa_heads.choices
    if heads_tree is not None:  # the tree `specray train medusa` fitted to these heads
        configs["medusa fitted"] = SpeculationParams(method="medusa")

    best = {c: [float("inf")] * len(prompts) for c in configs}
    tokens: dict[str, list] = {c: [None] * len(prompts) for c in configs}
    metrics: dict[str, list] = {c: [None] * len(prompts) for c in configs}
    engine.generate(prompts[:1], sampling, configs["plain"])  # warm-up
    for _ in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name, spec in configs.items():
                start = time.perf_counter()
                out = engine.generate([prompt], sampling, spec)[0]
                best[name][i] = min(best[name][i], time.perf_counter() - start)
                tokens[name][i], metrics[name][i] = out.token_ids, out.metrics

    rows = []
    plain_tps = None
    for name in configs:
        total = sum(len(t) for t in tokens[name])
        tps = total / sum(best[name])
        plain_tps = plain_tps or tps
        drafts = sum(m["num_drafts"] for m in metrics[name])
        accepted = sum(m["num_accepted_tokens"] for m in metrics[name])
        forwards = sum(m["target_forward_passes"] for m in metrics[name])
        spec = configs[name]
        rows.append({
            "config": name,
            "tokens_per_s": round(tps, 1),
            "x_plain": round(tps / plain_tps, 3),
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
            "tokens_per_target_forward": round(total / forwards, 3),
            "ms_per_step": round(1000 * sum(best[name]) / forwards, 3),
            "tree_tokens": resolve_tree(spec, engine.medusa_heads.num_heads, heads_tree).size
            if spec.method == "medusa" else "",
            "mismatches_vs_plain": sum(a != b for a, b in zip(tokens[name], tokens["plain"])),
        })
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{'config':<22} {'tok/s':>7} {'x plain':>8} {'acc.len':>8} {'tok/fwd':>8} {'ms/step':>8} "
              f"{'tree':>5} {'mism':>5}")
    lines = [header] + [
        f"{r['config']:<22} {r['tokens_per_s']:>7.1f} {r['x_plain']:>8.3f} {r['mean_accepted_length']:>8.3f} "
        f"{r['tokens_per_target_forward']:>8.3f} {r['ms_per_step']:>8.3f} {str(r['tree_tokens']):>5} "
        f"{r['mismatches_vs_plain']:>5}"
        for r in rows
    ]
    print("\n".join(lines))
    (out / "medusa.txt").write_text("\n".join(lines) + "\n")
    (out / "medusa.json").write_text(json.dumps(rows, indent=2))
    with open(out / "medusa.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r["config"] for r in rows], [r["tokens_per_s"] for r in rows])
    ax.set_ylabel("tokens/s (batch 1, greedy)")
    ax.set_title("specray on the demo pair: Medusa trees vs plain and draft")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(out / "medusa.png", dpi=120)
    return 0 if all(r["mismatches_vs_plain"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
