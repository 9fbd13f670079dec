"""Online learning on a shifted workload: mean accepted length per step over the first N served
requests, learning on against off, for the draft model and EAGLE on the demo pair.

    python -m specray.bench.online [--methods draft,eagle] [--requests 300] [--max-tokens 32]
                                   [--wave 10] [--window 30] [--round-requests 60] [--steps 100]
                                   [--batch-size 16] [--greedy-temperature 0.25] [--eagle DIR]
                                   [--out bench/results]
    python -m specray.bench.online --overhead [--requests 100] [--repeats 3]   # capture's cost
    python -m specray.bench.online --live [--requests 300] [--concurrency 4]   # a live server (online_live.py)

``--live`` measures the path users start — ``specray serve --online-learning`` under continuous
HTTP load, training asynchronously in the server's trainer actor (``bench/online_live.py``); the
rest of this page describes the in-process loop, which pumps a round between waves of requests.

The workload (``bench/shifted.py``) is German, French and Spanish sentences — the demo pair and
its heads learned Python source. The same ``--requests`` prompts are served twice per method,
in waves of ``--wave`` concurrent requests (greedy, ``--max-tokens`` each, one torch thread):
once with learning off and once on (``actors/learner.py``'s in-process ``OnlineLearner``:
every ``--round-requests`` captured requests a round of ``--steps`` of the method's recipe runs
between waves, and the gate publishes the candidate only if it accepts more on held-out recent
traffic). Both runs must produce the same tokens (the target's). Prints the curve — mean
accepted length per step over each window of ``--window`` requests — and tokens/s of serving
(tokens per CPU second of this process, training time excluded) beside it; writes online.{json,png} to --out. Without ``--eagle`` an
EAGLE head is trained once on the demo target (300 steps, cached).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

# Fixed speculation (the self-tuning length would mix CPU-timing noise into the acceptance):
# the draft model at k = 5, EAGLE with its own fitted tree given explicitly.
SPECS = {"draft": {"method": "draft", "num_speculative_tokens": 5}, "eagle": {"method": "eagle"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.online", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="draft,eagle")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--wave", type=int, default=10, help="requests served together (continuous batching)")
    p.add_argument("--window", type=int, default=30, help="requests per point of the curve")
    p.add_argument("--round-requests", type=int, default=60, help="captured requests per training round")
    p.add_argument("--steps", type=int, default=100, help="optimiser steps per round")
    p.add_argument("--batch-size", type=int, default=16, help="sequences (draft) or windows (heads) per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--greedy-temperature", type=float, default=0.25,
                   help="the teacher's temperature for greedy requests (draft model; 1: the target's distribution)")
    p.add_argument("--eagle", default=None, help="an EAGLE head dir (default: train one on the demo target, cached)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead", action="store_true",
                   help="instead: serving speed with capture on (every request) against off, no training")
    p.add_argument("--repeats", type=int, default=3, help="--overhead: interleaved runs per config (best kept)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--live", action="store_true",
                   help="instead: `specray serve --online-learning` under continuous HTTP load (bench/online_live.py)")
    p.add_argument("--concurrency", type=int, default=4, help="--live: requests in flight")
    p.add_argument("--config", default=None, help="--live: a serve config file for both servers")
    args = p.parse_args(argv)
    if args.live:
        from specray.bench.online_live import run

        return run(args)

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _overhead(args) if args.overhead else _run(args)
    finally:
        torch.set_num_threads(threads)


def demo_eagle_head(target: str, tokenizer: str) -> str:
    """A short EAGLE head on the demo target (trained once, through ``specray train eagle``)."""
    from specray.demo import default_cache_dir
    from specray.entrypoints.cli import main as cli

    out = pathlib.Path(default_cache_dir()) / "online-bench" / "eagle-300"
    if not (out / "config.json").exists():
        cli(["train", "eagle", "--target", target, "--tokenizer", tokenizer, "--out", str(out), "--steps", "300",
             "--sequences", "256", "--gen-len", "64", "--tree-size", "8", "--depth", "5", "--threads", "1",
             "--no-eval"])
    return str(out)


def _serve(method: str, learn: bool, prompts, args, pair, eagle: str | None) -> dict:
    from specray.actors.learner import OnlineLearner, OnlineLearningConfig
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams

    cfg = OnlineLearningConfig(enabled=True, methods=[method], round_requests=args.round_requests, steps=args.steps,
                               batch_size=args.batch_size, lr=args.lr, greedy_temperature=args.greedy_temperature,
                               gate_options={method: {k: v for k, v in SPECS[method].items()
                                                                  if k != "method"}})
    engine = LLMEngine(EngineConfig(target=pair.target, tokenizer=pair.tokenizer, max_num_seqs=args.wave,
                                    draft=pair.draft if method == "draft" else None,
                                    checkpoints={"eagle": eagle} if method == "eagle" else {},
                                    online_learning=cfg.capture()))
    learner = OnlineLearner(engine, cfg) if learn else None
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    spec = SpeculationParams(**SPECS[method])
    rows, rounds, serve_s, train_s = [], [], 0.0, 0.0
    for lo in range(0, len(prompts), args.wave):
        start = time.process_time()  # CPU seconds of this process (one torch thread): less disturbed on shared cores
        outs = engine.generate(prompts[lo : lo + args.wave], sampling, spec)
        serve_s += time.process_time() - start
        for o in outs:
            m = o.metrics
            rows.append({"drafts": m["num_drafts"], "accepted": m["num_accepted_tokens"], "tokens": len(o.token_ids),
                         "version": m.get("drafter_version"), "ids": o.token_ids})
        if learner is not None:
            start = time.perf_counter()
            for r in learner.pump():
                rounds.append({"after_request": lo + len(outs), "published": r["published"], "version": r["version"],
                               "serving": round(r["serving"]["mean_accepted_length"], 3),
                               "candidate": round(r["candidate"]["mean_accepted_length"], 3),
                               "seconds": r["seconds"]})
            train_s += time.perf_counter() - start
    tokens = sum(r["tokens"] for r in rows)
    return {"rows": rows, "rounds": rounds, "serve_seconds": serve_s, "train_seconds": train_s,
            "tokens_per_s": tokens / serve_s}


def curve(rows: list[dict], window: int) -> list[float]:
    out = []
    for lo in range(0, len(rows), window):
        part = rows[lo : lo + window]
        drafts = sum(r["drafts"] for r in part)
        out.append(round(1 + sum(r["accepted"] for r in part) / max(drafts, 1), 3))
    return out


def _run(args) -> int:
    from specray.bench.shifted import shifted_prompts
    from specray.demo import load_or_build_demo_pair

    pair = load_or_build_demo_pair()
    prompts = shifted_prompts(args.requests, args.seed)
    methods = [m for m in args.methods.split(",") if m]
    eagle = (args.eagle or demo_eagle_head(pair.target, pair.tokenizer)) if "eagle" in methods else None
    if eagle is not None:
        choices = json.loads((pathlib.Path(eagle) / "config.json").read_text()).get("eagle_choices")
        SPECS["eagle"] = {"method": "eagle", **({"eagle_choices": choices} if choices else {"tree": "chain"})}
    report, ok = {"args": vars(args), "methods": {}}, True
    for method in methods:
        off = _serve(method, False, prompts, args, pair, eagle)
        on = _serve(method, True, prompts, args, pair, eagle)
        same = [a["ids"] for a in off["rows"]] == [b["ids"] for b in on["rows"]]
        ok &= same
        c_off, c_on = curve(off["rows"], args.window), curve(on["rows"], args.window)
        first = next((r["after_request"] for r in on["rounds"] if r["published"]), len(prompts))
        after_off, after_on = curve(off["rows"][first:], len(prompts)), curve(on["rows"][first:], len(prompts))
        report["methods"][method] = {
            "curve_off": c_off, "curve_on": c_on, "last_window_gain": round(c_on[-1] / c_off[-1] - 1, 3),
            "first_published_after": first, "after_first_publish_off": after_off[0] if after_off else None,
            "after_first_publish_on": after_on[0] if after_on else None,
            "rounds": on["rounds"], "identical_tokens": same,
            "tokens_per_s_off": round(off["tokens_per_s"], 1), "tokens_per_s_on": round(on["tokens_per_s"], 1),
            "train_seconds": round(on["train_seconds"], 1), "serve_seconds_on": round(on["serve_seconds"], 1),
            "serve_seconds_off": round(off["serve_seconds"], 1)}
        r = report["methods"][method]
        print(f"\n{method} ({json.dumps(SPECS[method])}): mean accepted length per step, per {args.window} requests")
        print(f"{'requests':>10} {'off':>7} {'on':>7} {'gain':>7}")
        for i, (a, b) in enumerate(zip(c_off, c_on)):
            print(f"{(i + 1) * args.window:>10} {a:>7.3f} {b:>7.3f} {b / a - 1:>+7.1%}")
        if r["after_first_publish_off"]:
            print(f"requests {first + 1}-{len(prompts)} (after the first published version): off "
                  f"{r['after_first_publish_off']:.3f}, on {r['after_first_publish_on']:.3f} "
                  f"({r['after_first_publish_on'] / r['after_first_publish_off'] - 1:+.1%})")
        print(f"tokens per CPU second serving (training excluded): off {r['tokens_per_s_off']}, on {r['tokens_per_s_on']}; "
              f"training {r['train_seconds']} s in {len(r['rounds'])} rounds, "
              f"published {[x['version'] for x in r['rounds'] if x['published']]}; identical tokens: {same}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "online.json").write_text(json.dumps(report, indent=2))
    _plot(report, args, out / "online.png")
    print(f"\nwrote {out / 'online.json'} and {out / 'online.png'}")
    return 0 if ok else 1


def _overhead(args) -> int:
    """Tokens per CPU second with capture on (every request of the method) and off, same prompts."""
    from specray.bench.shifted import shifted_prompts
    from specray.demo import load_or_build_demo_pair
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams
    from specray.engine.capture import CaptureConfig

    pair = load_or_build_demo_pair()
    prompts = shifted_prompts(args.requests, args.seed)
    methods = [m for m in args.methods.split(",") if m]
    eagle = (args.eagle or demo_eagle_head(pair.target, pair.tokenizer)) if "eagle" in methods else None
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    result = {}
    for method in methods:
        best = {}
        for _ in range(args.repeats):
            for capture in (False, True):
                engine = LLMEngine(EngineConfig(
                    target=pair.target, tokenizer=pair.tokenizer, max_num_seqs=args.wave,
                    draft=pair.draft if method == "draft" else None,
                    checkpoints={"eagle": eagle} if method == "eagle" else {},
                    online_learning=CaptureConfig(methods=(method,), top_k=20) if capture else None))
                start = time.process_time()
                outs = engine.generate(prompts, sampling, SpeculationParams(**SPECS[method]))
                rate = sum(len(o.token_ids) for o in outs) / (time.process_time() - start)
                best[capture] = max(best.get(capture, 0.0), rate)
                if capture:
                    assert len(engine.take_traces()) == len(prompts)
        result[method] = {"off": round(best[False], 1), "on": round(best[True], 1),
                          "ratio": round(best[True] / best[False], 3)}
        print(f"{method}: tokens per CPU second, capture off {best[False]:.1f}, on {best[True]:.1f} "
              f"(on / off = {best[True] / best[False]:.3f}; best of {args.repeats} interleaved runs)")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "online-overhead.json").write_text(json.dumps(result, indent=2))
    return 0


def _plot(report: dict, args, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = report["methods"]
    fig, axes = plt.subplots(1, len(methods), figsize=(5.2 * len(methods), 4), squeeze=False)
    for ax, (method, r) in zip(axes[0], methods.items()):
        x = [(i + 1) * args.window for i in range(len(r["curve_off"]))]
        ax.plot(x, r["curve_off"], "o-", color="#888", label="learning off")
        ax.plot(x, r["curve_on"], "o-", color="#2a7", label="learning on")
        for rd in r["rounds"]:
            if rd["published"]:
                ax.axvline(rd["after_request"], color="#2a7", lw=0.6, ls=":")
        ax.set_xlabel("requests served")
        ax.set_ylabel("mean accepted length per step")
        ax.set_title(f"{method}: shifted workload (dotted: a version published)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
