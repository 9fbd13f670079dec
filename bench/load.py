"""Load benchmark of the OpenAI-compatible server: plain vs speculative decoding under
concurrency, over HTTP, streaming.

    python -m specray.bench.load [--concurrency 1,8,32] [--requests-per-level N]
                                 [--max-tokens 64] [--duration-cap 60] [--out DIR]
                                 [--methods none,draft,ngram] [--k 3] [--rounds 3]

Starts Ray Serve on a free loopback port with the demo pair (one engine replica,
``max_num_seqs=32``, colocated target + draft, one torch thread per worker), then for
each concurrency level C runs a closed loop per method: C clients, each sending its
next streaming ``/v1/completions`` request as soon as its previous one ends, over
held-out prompts (``specray.demo.held_out_prompts``). Greedy, EOS ignored: every request
makes exactly ``--max-tokens`` tokens, so methods do equal work, and their texts must be
identical (speculation is lossless).

A level runs in ``--rounds`` rounds; a round runs every method in turn on the same
prompts, in an order rotated from round to round, ``max(ceil(N / rounds), C)`` requests
each (a run sends no new request after ``--duration-cap`` seconds). Methods measured
side by side in time share whatever load other processes put on the cores; the ratio of
each round's throughputs (paired, adjacent in time) is reported as a min..max range.

Measured per (level, method), from the client:

* throughput: output tokens / wall time (each run: first request sent to last one
  finished; summed over the rounds);
* TTFT: request sent to first streamed token, p50/p90/p99;
* ITL: time between streamed chunks, p50/p90/p99. A speculative step may carry several
  tokens in one chunk (as in vLLM's benchmark, ITL is per chunk);
* TPOT: per request, (end - first token) / (tokens - 1), p50/p90/p99 (per token).

A method is ``name`` (its k chosen each step by the engine's self-tuning controller; with
``--k``, that fixed k instead) or ``name@k`` (a fixed k), e.g. ``--methods
none,draft,draft@1,draft@2,draft@4``: the report then checks the controller's goal — at
every level the controller's throughput is at least 0.95x the best of plain and the best
fixed k of that method, and never below plain. ``--off-above-batch`` / ``--k-caps`` set
static caps instead of the controller (``speculation_off_above_batch`` /
``speculation_k_caps``).

Writes ``load.csv``, ``load.json``, ``load.txt`` (the table) and ``load.png`` to
``--out`` (default ``./specray-bench/``), and says for each level whether a speculative
method was slower than plain decoding. ``main(argv)`` returns 0, or 1 if any request
failed or any greedy text differed from plain decoding's.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import os
import platform
import shlex
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specray.bench import DEFAULT_OUT

log = logging.getLogger("specray.bench.load")

PROG = "python -m specray.bench.load"
APP = "specray-load"
MAX_PROMPTS = 48
"""Distinct held-out prompts at most (distinct token lengths in 32..128); reused beyond."""
SLOWER_TOLERANCE = 0.97
"""A speculative method counts as slower than plain below this throughput ratio (the
run-to-run noise on shared CPU cores is a few percent)."""


@dataclass
class RequestResult:
    prompt_index: int
    ok: bool
    status: int
    tokens: int = 0
    text: str = ""
    ttft: float | None = None
    latency: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- one streaming request ---------------------------------------------------------------
async def stream_one(client, url: str, body: dict, index: int) -> RequestResult:
    """Send one streaming completion; time its chunks as they arrive."""
    start = time.perf_counter()
    last = None
    pieces: list[str] = []
    result = RequestResult(prompt_index=index, ok=False, status=0)
    try:
        async with client.stream("POST", url, json=body) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")[:300]
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    result.ok = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"].get("message", "")
                    break
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.chunk_gaps.append(now - last)
                        last = now
                        pieces.append(choice["text"])
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = repr(e)
        result.ok = False
    result.latency = time.perf_counter() - start
    result.text = "".join(pieces)
    result.ok = result.ok and result.tokens > 0
    return result


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, indices: list[int],
                    speculation: dict, max_tokens: int, cap_s: float, timeout_s: float) -> tuple[list, float]:
    """Closed loop: ``concurrency`` clients share a queue of prompts (by index)."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for i in indices:
        queue.put_nowait(i)
    results: list[RequestResult] = []
    start = time.perf_counter()
    stop_sending = start + cap_s

    async def client_loop(client):
        while time.perf_counter() < stop_sending:
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = {
                "model": model, "prompt": prompts[index], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "speculation": speculation,
            }
            results.append(await stream_one(client, url, body, index))

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results, time.perf_counter() - start


def speculation_of(method: str, k: int | None) -> dict:
    """``name`` (the controller's k, or ``k`` if given) or ``name@k`` (a fixed k)."""
    name, _, fixed = method.partition("@")
    if name == "none":
        return {"method": "none"}
    if fixed:
        return {"method": name, "num_speculative_tokens": int(fixed)}
    return {"method": name} if k is None else {"method": name, "num_speculative_tokens": k}


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda v: None if v is None else round(1e3 * v, 2)  # noqa: E731
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.chunk_gaps]
    tpot = [(r.latency - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1 and r.ttft is not None]
    tokens = sum(r.tokens for r in ok)
    row = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "mean_tokens_per_chunk": round(tokens / max(1, sum(len(r.chunk_gaps) + 1 for r in ok)), 3),
    }
    for name, values in (("ttft", ttft), ("itl", gaps), ("tpot", tpot)):
        for q in (50, 90, 99):
            row[f"{name}_ms_p{q}"] = ms(percentile(values, q))
    return row


CONTROLLER_GOAL = 0.95
"""The controller's throughput against the best of plain and the best fixed k, per level."""


def _controller_goal(rows: list[dict], methods: list[str], levels: list[int]) -> dict:
    """For each method run both with the controller (``name``) and with fixed k (``name@k``)."""
    out, lines = {}, []
    for auto in [m for m in methods if m != "none" and "@" not in m]:
        fixed = [m for m in methods if m.startswith(auto + "@")]
        if not fixed:
            continue
        per_level = {}
        for c in levels:
            at = {r["method"]: r["throughput_tok_s"] for r in rows if r["concurrency"] == c}
            best_name = max(["none"] + fixed, key=lambda m: at.get(m, 0.0))
            ratio = at[auto] / at[best_name] if at.get(best_name) else None
            ok = ratio is not None and ratio >= CONTROLLER_GOAL and at[auto] >= SLOWER_TOLERANCE * at["none"]
            per_level[c] = {"ratio_to_best": round(ratio, 3) if ratio else None, "best": best_name, "met": ok}
            lines.append(f"concurrency {c:>3}: {auto} (controller) {ratio:.2f}x the best of none/fixed k "
                         f"({best_name}) -> {'MET' if ok else 'NOT MET'}")
        out[auto] = {"levels": per_level, "met": all(v["met"] for v in per_level.values())}
    return {**out, "lines": lines}


# -- the server ------------------------------------------------------------------------------
def engine_config(args):
    """The engine's SpecrayConfig, with the demo pair's paths filled in if none given."""
    from specray.actors.config import SpecrayConfig

    policy = {}
    if args.off_above_batch is not None:
        policy["speculation_off_above_batch"] = args.off_above_batch
    if args.k_caps:
        policy["speculation_k_caps"] = [tuple(int(v) for v in pair.split(":")) for pair in args.k_caps.split(",")]
    target, draft, tokenizer = args.target, args.draft, args.tokenizer
    if target is None:  # the demo pair
        from specray.demo import load_or_build_demo_pair

        pair = load_or_build_demo_pair()
        target, draft, tokenizer = pair.target, draft or pair.draft, tokenizer or pair.tokenizer
    return SpecrayConfig(
        target=target, draft=draft, tokenizer=tokenizer, max_num_seqs=args.max_num_seqs,
        placement={"mode": args.placement}, **policy,
    ).resolved()


def start_server(args, engine) -> str:
    """Ray (in-process, our own) + Serve on a free loopback port; returns the base URL."""
    import ray
    from ray import serve

    from specray.entrypoints.app import build_app

    threads = os.environ.setdefault("SPECRAY_WORKER_THREADS", "1")
    ray.init(
        address="local",  # a Ray of our own, even if `ray start` left a cluster to join
        num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"SPECRAY_WORKER_THREADS": threads}},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = {
        "model_name": APP,
        "engine": engine.model_dump(),
        # Every level's clients must reach the engine at once: nothing rejected, nothing
        # queued in front of the engine's own batch.
        "max_ongoing_requests": max(args.max_num_seqs, max(args.levels)) + 8,
        "max_queued_requests": max(args.levels) + 8,
    }
    serve.run(build_app(cfg), name="load", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop_server() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


# -- the report ------------------------------------------------------------------------------
COLUMNS = [  # (row key, title, format)
    ("concurrency", "conc", "{}"), ("method", "method", "{}"), ("requests", "reqs", "{}"),
    ("failed", "fail", "{}"), ("throughput_tok_s", "tok/s", "{:.1f}"), ("speedup_vs_none", "x none", "{:.2f}"),
    ("speedup_round_min", "rounds min", "{:.2f}"), ("speedup_round_max", "max", "{:.2f}"),
    ("mean_tokens_per_chunk", "tok/chunk", "{:.2f}"),
    ("ttft_ms_p50", "TTFT p50", "{:.1f}"), ("ttft_ms_p90", "p90", "{:.1f}"), ("ttft_ms_p99", "p99", "{:.1f}"),
    ("itl_ms_p50", "ITL p50", "{:.1f}"), ("itl_ms_p90", "p90", "{:.1f}"), ("itl_ms_p99", "p99", "{:.1f}"),
    ("tpot_ms_p50", "TPOT p50", "{:.1f}"), ("tpot_ms_p90", "p90", "{:.1f}"), ("tpot_ms_p99", "p99", "{:.1f}"),
    ("same_text_as_none", "same text", "{}"),
]


def format_table(rows: list[dict]) -> str:
    """Fixed-width table (times in ms); '-' where a value is missing."""
    cells = [[title for _, title, _ in COLUMNS]]
    for r in rows:
        cells.append(["-" if r.get(key) is None else fmt.format(r[key]) for key, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) if COLUMNS[i][0] == "method" else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    )


def verdicts(rows: list[dict], methods: list[str]) -> tuple[list[str], dict]:
    """Per level: is any speculative method slower than plain? And the goal's status."""
    lines, per_level = [], {}
    levels = sorted({r["concurrency"] for r in rows})
    for c in levels:
        at = {r["method"]: r for r in rows if r["concurrency"] == c}
        if "none" not in at:
            continue
        parts, slower = [], []
        for m in methods:
            if m == "none" or m not in at:
                continue
            ratio = at[m].get("speedup_vs_none")
            lo, hi = at[m].get("speedup_round_min"), at[m].get("speedup_round_max")
            spread = f" (rounds {lo:.2f}..{hi:.2f})" if lo is not None and hi is not None else ""
            parts.append(f"{m} {ratio:.2f}x{spread}" if ratio is not None else f"{m} -")
            if ratio is not None and ratio < SLOWER_TOLERANCE:
                slower.append(m)
        per_level[c] = {"slower": slower, "ratios": {m: at[m].get("speedup_vs_none") for m in at if m != "none"}}
        verdict = f"SLOWER than plain: {', '.join(slower)}" if slower else "not slower than plain"
        lines.append(f"concurrency {c:>3}: {'; '.join(parts)} -> {verdict}")
    controller = _controller_goal(rows, methods, levels)
    lines += controller.pop("lines")
    never_slower = all(not v["slower"] for v in per_level.values())
    low = levels[0] if levels else None
    faster_low = low is not None and any(
        (ratio or 0) > 1.0 / SLOWER_TOLERANCE for ratio in per_level.get(low, {}).get("ratios", {}).values()
    )
    goal = {
        "never_slower": never_slower,
        "faster_at_lowest_concurrency": faster_low,
        "met": never_slower and faster_low,
        "tolerance": SLOWER_TOLERANCE,
        "controller": controller,
    }
    lines.append(
        "goal 'speculation never slower than plain at any concurrency, faster at low concurrency': "
        + ("MET" if goal["met"] else "NOT MET")
        + f" (never slower: {never_slower}; faster at concurrency {low}: {faster_low};"
        f" slower means < {SLOWER_TOLERANCE:.2f}x)"
    )
    return lines, goal


def plot(rows: list[dict], methods: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for i, m in enumerate(methods):
        color = f"C{i}"  # one colour per method; p50 solid, p99 dotted
        pts = {r["concurrency"]: r for r in rows if r["method"] == m}
        xs = [c for c in levels if c in pts]
        axes[0].plot(xs, [pts[c]["throughput_tok_s"] for c in xs], marker="o", color=color, label=m)
        for ax, name in ((axes[1], "ttft"), (axes[2], "tpot")):
            ax.plot(xs, [pts[c][f"{name}_ms_p50"] or 0 for c in xs], marker="o", color=color, label=f"{m} p50")
            ax.plot(xs, [pts[c][f"{name}_ms_p99"] or 0 for c in xs], marker="x", linestyle=":", color=color,
                    label=f"{m} p99")
    for ax, label in zip(axes, ("output tokens/s", "TTFT (ms)", "TPOT (ms per token)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, rows: list[dict], meta: dict, table: str, verdict_lines: list[str], methods) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "load.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k, _, _ in COLUMNS] + [
            k for k in rows[0] if k not in {c for c, _, _ in COLUMNS}])
        writer.writeheader()
        writer.writerows(rows)
    (out / "load.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "load.txt").write_text("\n".join([meta["command"], "", table, "", *verdict_lines]) + "\n")
    plot(rows, methods, out / "load.png", meta["title"])


# -- main ------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts (default 1,8,32)")
    p.add_argument("--requests-per-level", type=int, default=32,
                   help="requests per (level, method), split over --rounds; each round has at least one "
                        "request per client (default 32)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per level; each runs every method in turn, order rotated (default 3)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request, EOS ignored (default 64)")
    p.add_argument("--duration-cap", type=float, default=60.0,
                   help="seconds after which a (level, method) run sends no new requests (default 60)")
    p.add_argument("--methods", default="none,draft,ngram", help="speculation methods (default none,draft,ngram)")
    p.add_argument("--k", type=int, default=None,
                   help="a fixed num_speculative_tokens for methods without @k (default: the engine's controller)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine batch rows (default 32)")
    p.add_argument("--placement", choices=["colocated", "separate"], default="colocated",
                   help="colocated: one actor holds target and draft (default); separate: an actor each")
    p.add_argument("--off-above-batch", type=int, default=None,
                   help="engine speculation_off_above_batch: plain decoding above this running batch (default: off)")
    p.add_argument("--k-caps", default="", help="engine speculation_k_caps as min_batch:max_k,... (e.g. 4:2,8:1)")
    p.add_argument("--prompt-tokens", default="32,128", help="held-out prompt lengths min,max (default 32,128)")
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the demo pair)")
    p.add_argument("--draft", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"output folder (default ./{DEFAULT_OUT})")
    args = p.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency needs positive integers")
    if args.rounds < 1 or args.requests_per_level < 1:
        p.error("--rounds and --requests-per-level must be >= 1")
    if "none" not in args.method_list:
        args.method_list.insert(0, "none")  # the baseline every ratio refers to
    args.prompt_range = tuple(int(v) for v in args.prompt_tokens.split(","))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    import torch

    torch.set_num_threads(1)  # the client side: parsing only, leave the cores to the workers
    command = PROG + " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(f"command: {command}", flush=True)

    from specray.demo import held_out_prompts

    rows: list[dict] = []
    failures: list[str] = []
    started = time.time()
    engine = engine_config(args)
    per_round = {c: max(-(-args.requests_per_level // args.rounds), c) for c in args.levels}
    n_prompts = min(MAX_PROMPTS, max(n * args.rounds for n in per_round.values()))
    prompts = held_out_prompts(n_prompts, engine.tokenizer or engine.target, *args.prompt_range)
    model = APP
    url = start_server(args, engine)
    try:
        endpoint = f"{url}/v1/completions"
        specs = {m: speculation_of(m, args.k) for m in args.method_list}
        # Warm-up: start the workers, and the proposers of each method.
        for m in args.method_list:
            res, _ = asyncio.run(run_level(endpoint, model, prompts, 2, [0, 1], specs[m], 8, 60, args.request_timeout))
            if not all(r.ok for r in res):
                raise RuntimeError(f"warm-up with {m} failed: {[r.error or r.status for r in res]}")
        methods = args.method_list
        for c in args.levels:
            n = per_round[c]
            results = {m: [] for m in methods}
            walls = {m: 0.0 for m in methods}
            round_tput: dict[str, list[float]] = {m: [] for m in methods}
            for rnd in range(args.rounds):
                # Every method in turn, on the same prompts, order rotated each round: load
                # from other processes on shared cores then falls on all methods alike.
                indices = [(rnd * n + j) % len(prompts) for j in range(n)]
                order = methods[rnd % len(methods):] + methods[: rnd % len(methods)]
                for m in order:
                    log.info("concurrency %d, round %d/%d, %s: %d requests", c, rnd + 1, args.rounds, m, n)
                    res, wall = asyncio.run(run_level(endpoint, model, prompts, c, indices, specs[m],
                                                      args.max_tokens, args.duration_cap, args.request_timeout))
                    results[m] += res
                    walls[m] += wall
                    round_tput[m].append(sum(r.tokens for r in res if r.ok) / wall if wall > 0 else 0.0)
            texts = {m: {r.prompt_index: r.text for r in results[m] if r.ok} for m in methods}
            base = summarize(results["none"], walls["none"])
            for m in methods:
                row = {"concurrency": c, "method": m, **summarize(results[m], walls[m])}
                row["speedup_vs_none"] = (
                    round(row["throughput_tok_s"] / base["throughput_tok_s"], 3) if base["throughput_tok_s"] else None
                )
                # Paired by round (adjacent in time): the spread says how noisy the ratio is.
                ratios = [t / b for t, b in zip(round_tput[m], round_tput["none"]) if b > 0]
                row["speedup_round_min"] = round(min(ratios), 3) if ratios else None
                row["speedup_round_max"] = round(max(ratios), 3) if ratios else None
                common = texts[m].keys() & texts["none"].keys()
                row["same_text_as_none"] = all(texts[m][i] == texts["none"][i] for i in common)
                if not row["same_text_as_none"]:
                    failures.append(f"c={c} {m}: greedy text differs from plain decoding")
                failures += [f"c={c} {m} prompt {r.prompt_index}: {r.status} {r.error}" for r in results[m] if not r.ok]
                rows.append(row)
    finally:
        stop_server()

    table = format_table(rows)
    verdict_lines, goal = verdicts(rows, methods)
    pair = _pair_info(args)
    policy = (f", spec off above batch {args.off_above_batch}" if args.off_above_batch is not None else "") + (
        f", k caps {args.k_caps}" if args.k_caps else "")
    k = f"k={args.k}" if args.k is not None else "k by the controller"
    title = (f"specray load: {pair.get('name', 'custom models')}, max_num_seqs={args.max_num_seqs}, "
             f"{args.placement}, {k}{policy}, {args.max_tokens} tokens/request, {os.cpu_count()} CPUs")
    meta = {
        "command": command, "title": title, "started": started, "elapsed_s": round(time.time() - started, 1),
        "python": platform.python_version(), "torch_threads_per_worker": os.environ.get("SPECRAY_WORKER_THREADS"),
        "cpu_count": os.cpu_count(), "pair": pair, "goal": goal, "failures": failures[:50],
        "args": {k: v for k, v in vars(args).items() if k not in ("levels", "method_list", "prompt_range")},
    }
    print()
    print(title)
    print(table)
    print()
    print("\n".join(verdict_lines))
    if failures:
        print(f"\n{len(failures)} failure(s):\n  " + "\n  ".join(failures[:10]))
    out = Path(args.out)
    write_outputs(out, rows, meta, table, verdict_lines, methods)
    print(f"\nwrote {out / 'load.csv'}, {out / 'load.json'}, {out / 'load.txt'}, {out / 'load.png'}")
    return 1 if failures else 0


def _pair_info(args) -> dict:
    if args.target is not None:
        return {"name": f"target {args.target}", "target": args.target, "draft": args.draft}
    from specray.demo import load_or_build_demo_pair

    pair = load_or_build_demo_pair()
    return {"name": f"demo pair (alpha {pair.alpha:.2f}, c {pair.cost_ratio:.2f})", **asdict(pair)}


if __name__ == "__main__":
    sys.exit(main())
