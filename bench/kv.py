"""Paged KV against the contiguous cache, prefix caching, on the demo pair.

    python -m specray.bench.kv [--requests 32] [--kv-tokens 6144] [--method none] [--out specray-bench]

Three measurements, each side by side in one run (one torch thread; times are this
process's CPU seconds, which other work on shared cores does not inflate):

1. **Capacity.** One KV byte budget (``--kv-tokens`` tokens of the target's K and V) serves
   ``--requests`` requests with prompts of 32-1,024 tokens and outputs of 16-512 (EOS
   ignored): the contiguous cache holds budget / max_model_len (1,536) sequences at once;
   the paged pool holds as many as its blocks fit (``max_num_seqs`` 64 as a cap), preempting
   when they run out. Requests running per step (mean and peak) and tokens per CPU second.
   Goal (issue 27): paged >= 3x the concurrent requests, and more tokens/s. Outputs are
   checked equal.
2. **Time to first token with a shared 512-token system prompt**: the step that admits a
   request (system prompt + a short question) and yields its first token, with the prefix
   cached (after one warm-up request) and with prefix caching off. Goal: >= 5x faster.
3. **Prefix-cache hit rate with an EAGLE head** (a quick-trained head, cached) on repeated
   prompts of 256-1,024 tokens: prompt tokens served from the cache over prompt tokens of
   the repeated requests; beside it, the rate had one block per request been dropped at the
   boundary (what vLLM does for EAGLE heads). Goal: >= 0.95.

Writes kv.{txt,json,png} to --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

from specray.bench import DEFAULT_OUT, announce

MAX_MODEL_LEN = 1536
GOALS = {"concurrency": 3.0, "ttft": 5.0, "hit_rate": 0.95}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.kv", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64, help="requests of the capacity run")
    p.add_argument("--kv-tokens", type=int, default=6144,
                   help="the KV budget, in target tokens (the contiguous cache holds this / 1536 sequences)")
    p.add_argument("--method", default="none", help="speculation of the capacity run (none: the cache alone)")
    p.add_argument("--questions", type=int, default=24, help="requests timed for time to first token (their mean)")
    p.add_argument("--repeated", type=int, default=6, help="distinct prompts of the hit-rate run (each 4 times)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="capacity,ttft,hit_rate", help="measurements to run (comma-separated)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    args = p.parse_args(argv)
    command = announce("kv", argv)

    from specray.demo import corpus_prompts, load_or_build_demo_pair

    pair = load_or_build_demo_pair()
    rng = random.Random(args.seed)
    result = {"command": command}
    for name, measure in (("capacity", capacity), ("ttft", ttft), ("hit_rate", hit_rate)):
        if name in args.only.split(","):
            result[name] = measure(pair, args, rng, corpus_prompts)
    text = report(result)
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv.txt").write_text(text + "\n")
    (out / "kv.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "kv.png")
    c, t, h = (result.get(k) for k in ("capacity", "ttft", "hit_rate"))
    met = ((c is None or (c["concurrency_x"] >= GOALS["concurrency"] and c["throughput_x"] > 1))
           and (t is None or t["speedup"] >= GOALS["ttft"]) and (h is None or h["hit_rate"] >= GOALS["hit_rate"]))
    return 0 if met else 1


def _engine(pair, **kw):
    from specray.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer, **kw))


def _bytes_per_token(pair) -> int:
    from transformers import AutoConfig

    from specray.engine.memory import kv_bytes_per_token

    return kv_bytes_per_token(AutoConfig.from_pretrained(pair.target), "float32")


def _drive(engine, prompts, sampling, speculation) -> dict:
    """Run every request to the end, counting the requests running at each step."""
    from specray.engine import SpeculationParams

    ids = [engine.add_request(pr, sp, SpeculationParams(method=speculation)) for pr, sp in zip(prompts, sampling)]
    running, queued, done = [], [], {}
    start, wall = time.process_time(), time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        running.append(len(engine.scheduler.running) + sum(1 for o in outs if o.finished))
        queued.append(len(engine.scheduler.waiting))
        for o in outs:
            if o.finished:
                done[o.request_id] = o
    seconds, wall = time.process_time() - start, time.perf_counter() - wall
    tokens = sum(len(o.token_ids) for o in done.values())
    # While requests wait, the cache is what limits the batch: the capacity measure.
    held = [n for n, q in zip(running, queued) if q] or running
    return {"tokens": tokens, "cpu_s": round(seconds, 2), "wall_s": round(wall, 2), "tok_s": round(tokens / seconds, 1),
            "held": round(sum(held) / len(held), 2), "held_steps": len(held),
            "mean_running": round(sum(running) / len(running), 2), "peak_running": max(running), "steps": len(running),
            "preemptions": engine.scheduler.preemptions, "ids": [done[i].token_ids for i in ids]}


def capacity(pair, args, rng, corpus_prompts) -> dict:
    from specray.engine import SamplingParams

    per_token = _bytes_per_token(pair)
    budget = args.kv_tokens * per_token
    lengths = [int(32 * 32 ** rng.random()) for _ in range(args.requests)]  # 32..1024, log-uniform
    prompts = []
    for n in lengths:
        prompts += corpus_prompts(1, pair.tokenizer, "held_out", max(16, n - 8), n, seed=rng.randrange(10**6),
                                  distinct_lengths=False)
    sampling = [SamplingParams(max_tokens=int(16 * 32 ** rng.random()), temperature=0, ignore_eos=True)
                for _ in prompts]  # 16..512
    rows = args.kv_tokens // MAX_MODEL_LEN
    contiguous = _drive(_engine(pair, paged_kv=False, max_num_seqs=rows, max_model_len=MAX_MODEL_LEN),
                        prompts, sampling, args.method)
    paged = _drive(_engine(pair, kv_cache_memory_bytes=budget, max_num_seqs=64, max_model_len=MAX_MODEL_LEN),
                   prompts, sampling, args.method)
    if paged.pop("ids") != contiguous.pop("ids"):
        raise AssertionError("paged and contiguous outputs differ")
    return {"budget_bytes": budget, "budget_tokens": args.kv_tokens, "contiguous_rows": rows, "requests": len(prompts),
            "method": args.method, "contiguous": contiguous, "paged": paged,
            "concurrency_x": round(paged["held"] / contiguous["held"], 2),
            "throughput_x": round(paged["tok_s"] / contiguous["tok_s"], 2)}


def ttft(pair, args, rng, corpus_prompts) -> dict:
    from specray.engine import SamplingParams, SpeculationParams

    system = corpus_prompts(1, pair.tokenizer, "held_out", 500, 512, seed=7)[0]
    questions = corpus_prompts(args.questions + 1, pair.tokenizer, "held_out", 12, 40, seed=8, distinct_lengths=False)
    sampling = SamplingParams(max_tokens=1, temperature=0)
    out = {}
    for cached in (True, False):
        engine = _engine(pair, enable_prefix_caching=cached, max_num_seqs=4)
        engine.generate([system + "\n" + questions[0]], sampling, SpeculationParams(method="none"))  # warm-up
        times = []
        for q in questions[1:]:
            engine.add_request(system + "\n" + q, sampling, SpeculationParams(method="none"))
            start = time.process_time()
            while not any(o.token_ids for o in engine.step()):
                pass
            times.append(time.process_time() - start)
            while engine.has_unfinished():
                engine.step()
        out["cached" if cached else "uncached"] = round(1000 * sum(times) / len(times), 2)
    tokens = len(engine.tokenizer(system, add_special_tokens=False)["input_ids"])
    return {"system_tokens": tokens, "cached_ms": out["cached"], "uncached_ms": out["uncached"],
            "speedup": round(out["uncached"] / out["cached"], 2)}


def hit_rate(pair, args, rng, corpus_prompts) -> dict:
    from specray.demo.pair import default_cache_dir
    from specray.engine import SamplingParams, SpeculationParams
    from specray.training.recipes import cached_heads

    root = default_cache_dir() / f"quick-heads-kv-{pathlib.Path(pair.target).parent.name}"
    heads = cached_heads(pair.target, pair.tokenizer, str(root), ["eagle"], "quick")
    engine = _engine(pair, checkpoints={"eagle": heads["eagle"]}, max_num_seqs=4)
    prompts = corpus_prompts(args.repeated, pair.tokenizer, "held_out", 256, 1024, seed=9)
    order = [p for p in prompts for _ in range(4)]
    rng.shuffle(order)
    seen, queries, hits, dropped = set(), 0, 0, 0
    sampling = SamplingParams(max_tokens=16, temperature=0)
    block = engine.paging.block_size
    for prompt in order:
        before = engine.stats()["kv"]
        engine.generate([prompt], sampling, SpeculationParams(method="eagle"))
        after = engine.stats()["kv"]
        if prompt in seen:
            q, h = after["prefix_queries"] - before["prefix_queries"], after["prefix_hits"] - before["prefix_hits"]
            queries, hits, dropped = queries + q, hits + h, dropped + max(h - block, 0)
        seen.add(prompt)
    return {"prompts": len(prompts), "requests": len(order), "hit_rate": round(hits / queries, 4),
            "hit_rate_last_block_dropped": round(dropped / queries, 4),
            "overall_hit_rate": round(engine.stats()["kv"]["prefix_hits"] / engine.stats()["kv"]["prefix_queries"], 4)}


def report(r: dict) -> str:
    c, t, h = (r.get(k) for k in ("capacity", "ttft", "hit_rate"))
    lines = [r["command"]]
    if c:
        lines += [f"1. capacity: {c['requests']} requests (prompts 32-1024, outputs 16-512 tokens, method {c['method']}) "
                  f"in one KV budget of {c['budget_tokens']} target tokens ({c['budget_bytes'] / 2**20:.1f} MiB)",
                  f"   {'layout':12s} {'held':>6s} {'mean running':>12s} {'peak':>5s} {'steps':>6s} {'preempted':>9s} "
                  f"{'tok/CPU s':>10s}"]
        for name in ("contiguous", "paged"):
            x = c[name]
            lines.append(f"   {name:12s} {x['held']:6.2f} {x['mean_running']:12.2f} {x['peak_running']:5d} "
                         f"{x['steps']:6d} {x['preemptions']:9d} {x['tok_s']:10.1f}")
        lines.append("   (held: requests running per step while others waited, i.e. what the cache lets run; "
                     "mean running: over every step, the drain at the end included)")
        lines.append(f"   paged / contiguous: {c['concurrency_x']:.2f}x requests held (goal >= "
                     f"{GOALS['concurrency']}x), {c['throughput_x']:.2f}x tokens/s (goal > 1x); outputs identical")
    if t:
        lines.append(f"2. time to first token, {t['system_tokens']}-token shared system prompt: cached "
                     f"{t['cached_ms']:.1f} ms, uncached {t['uncached_ms']:.1f} ms: {t['speedup']:.2f}x "
                     f"(goal >= {GOALS['ttft']}x)")
    if h:
        lines.append(f"3. prefix-cache hit rate with an EAGLE head, {h['prompts']} prompts x 4: {h['hit_rate']:.4f} of "
                     f"the repeated requests' prompt tokens (goal >= {GOALS['hit_rate']}); with the last block "
                     f"dropped (vLLM's EAGLE rule): {h['hit_rate_last_block_dropped']:.4f}; over every request: "
                     f"{h['overall_hit_rate']:.4f}")
    return "\n".join(lines)


def plot(r: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    c, t = r.get("capacity"), r.get("ttft")
    if not (c and t):
        return
    fig, ax = plt.subplots(1, 3, figsize=(11, 3.2))
    ax[0].bar(["contiguous", "paged"], [c["contiguous"]["held"], c["paged"]["held"]])
    ax[0].set_title("requests held while others wait")
    ax[1].bar(["contiguous", "paged"], [c["contiguous"]["tok_s"], c["paged"]["tok_s"]])
    ax[1].set_title("tokens per CPU second")
    ax[2].bar(["uncached", "cached"], [t["uncached_ms"], t["cached_ms"]])
    ax[2].set_title(f"TTFT, {t['system_tokens']}-token prefix (ms)")
    fig.suptitle(f"paged KV, demo pair, one budget of {c['budget_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
