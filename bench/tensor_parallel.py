"""A tensor-parallel target against TP 1: ms per step, and what the control plane costs.

    python -m specray.bench.tensor_parallel [--tp 1,2] [--batch 1,8] [--method none,draft] [--out DIR]
    python -m specray.bench.tensor_parallel --layout llama-3-70b:4,llama-3.2-1b:1   # what each rank holds

Runs the same greedy workload (held-out demo prompts) through a colocated coordinator (the
draft, when the method has one, whole in rank 0) at each tensor-parallel size, and reports
per engine step (steps counted from the target's forward passes):

    ms/step    wall time of a step
    control    the control plane: what rank 0 spends recording and broadcasting its runner
               calls (``engine/mirror.py``), plus what the slowest other rank spends decoding
               them before its forward starts; ``share`` is its part of the step
    reduce     seconds rank 0 spent in the model's all-reduces (two per layer), waiting for
               the other ranks included: on CPU (gloo) these dominate a TP step
    messages   control messages per step (one per model forward: a step's lengths and
               compaction ride along with the next forward)

Every TP size's output is checked to be identical to TP 1's. On CPU the ranks are processes on
this machine's cores, joined by gloo: TP costs time here (the model is small, gloo's all-reduce
~1 ms); the figure that matters on CPU is the control plane's share. On GPUs (NCCL) the same
command measures a real split: ``--device cuda`` starts Ray with this machine's GPUs, one per
rank (docs/tensor-parallel.md gives the recipe and a cost-real model).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import pathlib
import sys
import time

from specray.bench import DEFAULT_OUT, announce

log = logging.getLogger("specray.bench.tensor_parallel")

# Published shapes (their config.json values) for --layout: nothing is downloaded, the models
# are built on the meta device and split as specray splits them.
SHAPES = {
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
}


def layout(spec: str, dtype_bytes: int = 2) -> list[dict]:
    """What each rank holds for ``spec`` = "shape:ranks,shape:ranks" (the target first): its
    parameters (the split layers' share, the embedding, rank 0's whole LM head), their bytes,
    its query and KV heads, and its KV cache bytes per token."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specray.engine.collectives import Groups
    from specray.engine.tensor_parallel import check_tensor_parallel, shard_model

    rows = []
    for role, item in zip(("target", "draft"), spec.split(",")):
        name, _, ranks = item.partition(":")
        size = int(ranks or 1)
        cfg = LlamaConfig(**SHAPES[name])
        with torch.device("meta"):
            whole = LlamaForCausalLM(cfg)
        for rank in range(size):
            model = copy.deepcopy(whole)
            info = check_tensor_parallel(cfg, size)
            if size > 1:
                info = shard_model(model, Groups(rank, size, tensors=None, control=None))
            held = {id(p): p.numel() for p in model.model.parameters()}
            if rank == 0:  # the LM head: rank 0 computes the logits (tied: the embedding itself)
                held[id(model.lm_head.weight)] = model.lm_head.weight.numel()
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            rows.append({"role": role, "shape": name, "rank": rank, "ranks": size,
                         "params_b": sum(held.values()) / 1e9, "weights_gib": sum(held.values()) * dtype_bytes / 2**30,
                         "q_heads": info.q_heads, "kv_heads": info.kv_heads,
                         "kv_kib_per_token": 2 * cfg.num_hidden_layers * info.kv_heads * head_dim * dtype_bytes / 1024})
    return rows


def print_layout(rows: list[dict]) -> None:
    print(f"{'role':<7} {'shape':<13} {'rank':>4} {'params (B)':>10} {'bf16 GiB':>9} {'q heads':>7} {'kv heads':>8} "
          f"{'KV KiB/token':>12}")
    for r in rows:
        print(f"{r['role']:<7} {r['shape']:<13} {r['rank']:>2}/{r['ranks']:<1} {r['params_b']:>10.2f} "
              f"{r['weights_gib']:>9.1f} {r['q_heads']:>7} {r['kv_heads']:>8} {r['kv_kib_per_token']:>12.0f}")


def _run(cfg, prompts, sampling, spec, repeats: int) -> dict:
    """The fastest of ``repeats`` runs of the workload through one coordinator, with the TP
    group's counters over that run."""
    import ray

    from specray.actors.coordinator import Coordinator

    c = Coordinator.remote(cfg.model_dump())
    try:
        ray.get(c.ready.remote())
        ray.get(c.generate.remote(prompts[:1], sampling.model_dump(), spec.model_dump()))  # warm-up
        worker = ray.get(c.workers.remote())["engine"]
        best = None
        for _ in range(repeats):
            before = ray.get(worker.tensor_parallel.remote())
            start = time.perf_counter()
            outs = ray.get(c.generate.remote(prompts, sampling.model_dump(), spec.model_dump()))
            seconds = time.perf_counter() - start
            after = ray.get(worker.tensor_parallel.remote())
            if best is None or seconds < best["seconds"]:
                best = {"seconds": seconds, "outs": outs, "tp": _delta(before, after)}
        steps = max(o["metrics"]["target_forward_passes"] for o in best["outs"])
        return {**best, "steps": steps, "tokens": [o["token_ids"] for o in best["outs"]]}
    finally:
        ray.get(c.shutdown.remote())
        ray.kill(c)


def _delta(before: dict | None, after: dict | None) -> dict:
    """The control plane's and the all-reduces' counters over one run (zeros at TP 1)."""
    if before is None or after is None:
        return {"messages": 0, "bytes": 0, "control_s": 0.0, "reduce_s": 0.0}
    r0, r1 = before["rank0"], after["rank0"]
    others = [a["seconds"] - b["seconds"] for a, b in zip(after["ranks"], before["ranks"])]
    return {"messages": r1["messages"] - r0["messages"], "bytes": r1["bytes"] - r0["bytes"],
            "control_s": (r1["seconds"] - r0["seconds"]) + max(others, default=0.0),
            "reduce_s": r1["reduce_seconds"] - r0["reduce_seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specray.bench.tensor_parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--method", default="none,draft", help="comma-separated methods (draft: k=3)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="runs per point (the fastest kept)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: ranks on this machine's cores (gloo); cuda: one GPU per rank (NCCL)")
    parser.add_argument("--target", default=None, help="target checkpoint (default: the demo pair's)")
    parser.add_argument("--draft", default=None, help="draft checkpoint (default: the demo pair's)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    parser.add_argument("--layout", metavar="SHAPE:N[,SHAPE:N]", default=None,
                        help=f"only print what each rank holds (shapes: {', '.join(SHAPES)}), e.g. "
                             "llama-3-70b:4,llama-3.2-1b:1; nothing runs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("SPECRAY_WORKER_THREADS", "1")
    command = announce("tensor_parallel", argv)
    if args.layout:
        print_layout(layout(args.layout))
        return 0

    import ray

    from specray.actors.config import SpecrayConfig
    from specray.demo import held_out_prompts, load_or_build_demo_pair
    from specray.engine.params import SamplingParams, SpeculationParams

    if args.target is None:
        pair = load_or_build_demo_pair()
        args.target, args.draft, args.tokenizer = pair.target, args.draft or pair.draft, args.tokenizer or pair.tokenizer
    sizes = [int(t) for t in args.tp.split(",")]
    base = SpecrayConfig(target=args.target, draft=args.draft, tokenizer=args.tokenizer, device=args.device,
                         placement={"mode": "colocated", "timeout_s": 120})
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    if args.device == "cpu":
        ray.init(num_cpus=max(4, 2 * max(sizes)), num_gpus=0, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for method in args.method.split(","):
            spec = SpeculationParams(method=method, **({"num_speculative_tokens": 3} if method == "draft" else {}))
            for batch in [int(b) for b in args.batch.split(",")]:
                prompts = held_out_prompts(batch, args.tokenizer, min_tokens=32, max_tokens=128)
                reference = None
                for tp in sizes:
                    cfg = base.model_copy(update={"tensor_parallel_size": tp, "max_num_seqs": batch}).resolved()
                    res = _run(cfg, prompts, sampling, spec, args.repeats)
                    reference = reference if reference is not None else res["tokens"]
                    steps, t = res["steps"], res["tp"]
                    step_ms = 1e3 * res["seconds"] / steps
                    control_ms = 1e3 * t["control_s"] / steps
                    rows.append({
                        "method": method, "batch": batch, "tp": tp, "ms_per_step": step_ms,
                        "tokens_per_s": sum(len(x) for x in res["tokens"]) / res["seconds"], "steps": steps,
                        "control_ms_per_step": control_ms, "control_share": control_ms / step_ms,
                        "reduce_ms_per_step": 1e3 * t["reduce_s"] / steps,
                        "messages_per_step": t["messages"] / steps, "bytes_per_message": t["bytes"] / max(t["messages"], 1),
                        "identical_to_tp1": res["tokens"] == reference,
                    })
                    log.info("%s batch %d tp %d: %.2f ms/step, control %.3f ms (%.1f%%)", method, batch, tp, step_ms,
                             control_ms, 100 * control_ms / step_ms)
    finally:
        ray.shutdown()
    _report(rows, pathlib.Path(args.out), command, args.device)
    return 0 if all(r["identical_to_tp1"] for r in rows) else 1


def _report(rows: list[dict], out: pathlib.Path, command: str, device: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    print(f"{'method':<7} {'batch':>5} {'tp':>3} {'ms/step':>8} {'tok/s':>7} {'control ms':>10} {'share':>6} "
          f"{'reduce ms':>9} {'msgs/step':>9} {'B/msg':>6}  identical")
    for r in rows:
        print(f"{r['method']:<7} {r['batch']:>5} {r['tp']:>3} {r['ms_per_step']:>8.2f} {r['tokens_per_s']:>7.1f} "
              f"{r['control_ms_per_step']:>10.3f} {r['control_share']:>6.1%} {r['reduce_ms_per_step']:>9.2f} "
              f"{r['messages_per_step']:>9.2f} {r['bytes_per_message']:>6.0f}  {r['identical_to_tp1']}")
    with open(out / "tensor_parallel.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "tensor_parallel.json").write_text(json.dumps({"command": command, "device": device, "rows": rows}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['method']} b{r['batch']} tp{r['tp']}" for r in rows]
    control = [r["control_ms_per_step"] for r in rows]
    reduce = [r["reduce_ms_per_step"] for r in rows]
    rest = [max(0.0, r["ms_per_step"] - c - d) for r, c, d in zip(rows, control, reduce)]
    ax.barh(labels, rest, label="compute and bookkeeping")
    ax.barh(labels, reduce, left=rest, label="all-reduces (rank 0 waiting)")
    ax.barh(labels, control, left=[a + b for a, b in zip(rest, reduce)], label="control plane")
    ax.set_xlabel("ms per step")
    ax.set_title(f"specray: tensor parallel on {device}, demo pair")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tensor_parallel.png", dpi=120)
    print(f"wrote {out / 'tensor_parallel.csv'}, {out / 'tensor_parallel.json'}, {out / 'tensor_parallel.png'}")


if __name__ == "__main__":
    sys.exit(main())
