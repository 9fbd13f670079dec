"""Per-step cost of the Ray actor layouts against the in-process engine.

    python -m specray.bench.actors [--batch 1,8] [--max-tokens 64] [--k 3] [--out DIR]

Runs the same greedy workload (draft speculation with a fixed k, held-out demo prompts)
through the in-process ``LLMEngine``, a colocated coordinator (one engine worker holds both
models), and a separate layout (target in the engine worker, draft and n-gram pool in
actors of their own) with and without overlapped drafting (set explicitly; unset, it is on
for GPU workers and off on the CPU), and reports milliseconds per engine step and tokens/s,
each layout's fastest of ``--repeats`` interleaved runs, with the spread of the runs beside
it (what the machine's other load adds). Each repeat also times one small actor-to-actor
call (the median of 200): the separate layout's step pays one such round trip to its draft
worker, which the in-process and colocated steps do not. Steps are counted from the target's forward passes, so the
numbers are per verification round. "draft ms" is the time per step the step driver waited
for drafts (the engine worker's own timers; in-process and colocated: the time drafting);
"recovered" is the share of the separate layout's draft wait that overlap removes. All
outputs are checked to be identical to the in-process engine's.

"cpu ms/step" is the CPU time (user + system) of this process and every process under it —
the Ray cluster it starts: GCS, raylet, the coordinator and the workers — per step: what a
layout costs, read from ``/proc`` (Linux), and steadier than wall time on shared cores, where
other jobs' load falls into every wall-clock number.
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
from specray.bench import DEFAULT_OUT

log = logging.getLogger("specray.bench.actors")


def _workload(engine_tokenizer_dir: str, n: int) -> list[str]:
    from specray.demo import held_out_prompts

    return held_out_prompts(n, engine_tokenizer_dir, min_tokens=32, max_tokens=128)


def process_tree_cpu_seconds() -> dict[int, float] | None:
    """CPU seconds (user + system) so far of this process and each of its descendants, by
    pid (None where ``/proc`` is missing)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        parent, cpu = {}, {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # after the command name: state, ppid, ...
            parent[int(entry)], cpu[int(entry)] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
    except (OSError, ValueError, AttributeError):
        return None
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        tree[pid] = cpu.get(pid, 0.0)
        todo += children.get(pid, [])
    return tree


def cpu_seconds_between(before: dict[int, float] | None, after: dict[int, float] | None) -> float:
    """CPU seconds the process tree spent between two readings: per process alive at the
    second (new ones from zero). A process that exited in between takes its time with it, so
    measure while the actors live; it never makes the total negative."""
    if before is None or after is None:
        return float("nan")
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())


def _timed(run):
    """(wall seconds, CPU seconds of the process tree, run's result)."""
    cpu, start = process_tree_cpu_seconds(), time.perf_counter()
    result = run()
    wall = time.perf_counter() - start
    return wall, cpu_seconds_between(cpu, process_tree_cpu_seconds()), result


def _time_local(cfg, prompts, sampling, spec) -> tuple[float, float, list, int, dict]:
    from specray.engine.llm_engine import LLMEngine

    engine = LLMEngine(cfg.engine_config())
    engine.generate(prompts[:1], sampling, spec)  # warm-up
    engine.stats(reset=True)
    secs, cpu, outs = _timed(lambda: engine.generate(prompts, sampling, spec))
    return secs, cpu, [o.token_ids for o in outs], _steps(outs), engine.stats()["phases"]


def _steps(outs) -> int:
    # Each verification round is one target forward for every running row; rows run
    # together, so the number of rounds is the largest per-request count.
    return max((o["metrics"] if isinstance(o, dict) else o.metrics)["target_forward_passes"] for o in outs)


def _time_coordinator(cfg, prompts, sampling, spec) -> tuple[float, float, list, int, dict]:
    import ray

    from specray.actors.coordinator import Coordinator

    c = Coordinator.remote(cfg.model_dump())
    try:
        ray.get(c.ready.remote())
        ray.get(c.generate.remote(prompts[:1], sampling.model_dump(), spec.model_dump()))  # warm-up
        workers = ray.get(c.workers.remote())
        worker = workers.get("target") or workers["engine"]
        ray.get(worker.phase_seconds.remote())  # reset
        seconds, cpu, outs = _timed(lambda: ray.get(c.generate.remote(prompts, sampling.model_dump(), spec.model_dump())))
        return seconds, cpu, [o["token_ids"] for o in outs], _steps(outs), ray.get(worker.phase_seconds.remote())
    finally:
        ray.get(c.shutdown.remote())
        ray.kill(c)


class _Echo:
    def echo(self, x):
        return x


class _Caller:
    """Times an actor-to-actor call, as the engine worker makes to a proposer worker (async
    caller, awaiting each reply)."""

    async def round_trips(self, callee, n: int) -> list[float]:
        await callee.echo.remote(0)
        times = []
        for i in range(n):
            start = time.perf_counter()
            await callee.echo.remote(i)
            times.append(time.perf_counter() - start)
        return times


def actor_round_trip_ms(n: int = 200) -> float:
    """Median milliseconds of one small actor call's round trip between two actors on this
    node: what each step of the separate layout pays at least once (the proposer's call), and
    what the colocated layout's long-poll pays per step off the step's path."""
    import statistics

    import ray

    callee, caller = ray.remote(num_cpus=0)(_Echo).remote(), ray.remote(num_cpus=0)(_Caller).remote()
    try:
        return 1e3 * statistics.median(ray.get(caller.round_trips.remote(callee, n)))
    finally:
        ray.kill(caller)
        ray.kill(callee)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specray.bench.actors", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step")
    parser.add_argument("--repeats", type=int, default=2,
                        help="interleaved runs per layout (the fastest kept; CPU time: the least)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("SPECRAY_WORKER_THREADS", "1")

    import ray
    import torch

    from specray.actors.config import SpecrayConfig
    from specray.demo import load_or_build_demo_pair
    from specray.engine.params import SamplingParams, SpeculationParams

    torch.set_num_threads(1)
    print("command: python -m specray.bench.actors " + " ".join(argv if argv is not None else sys.argv[1:]))
    pair = load_or_build_demo_pair()
    base = SpecrayConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer).resolved()
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    spec = SpeculationParams(method="draft", num_speculative_tokens=args.k)
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for batch in [int(b) for b in args.batch.split(",")]:
            prompts = _workload(base.tokenizer, batch)
            cfg = base.model_copy(update={"max_num_seqs": batch})
            colocated = cfg.model_copy(update={"placement": cfg.placement.model_copy(update={"mode": "colocated"})})
            layouts = {
                "in-process": lambda: _time_local(cfg, prompts, sampling, spec),
                "colocated actor": lambda: _time_coordinator(colocated, prompts, sampling, spec),
                "separate, overlap": lambda: _time_coordinator(
                    cfg.model_copy(update={"overlap_drafting": True}), prompts, sampling, spec),
                "separate, no overlap": lambda: _time_coordinator(
                    cfg.model_copy(update={"overlap_drafting": False}), prompts, sampling, spec),
            }
            # Interleaved repeats, each layout keeping its fastest run: load from other
            # processes on shared cores falls on all layouts alike.
            results: dict = {}
            least_cpu: dict = {}
            runs: dict = {}  # layout -> ms per step of each repeat (the spread the machine adds)
            round_trips = []
            for _ in range(args.repeats):
                for layout, run in layouts.items():
                    res = run()
                    if layout not in results or res[0] < results[layout][0]:
                        results[layout] = res
                    least_cpu[layout] = min(least_cpu.get(layout, float("inf")), res[1] / res[3])
                    runs.setdefault(layout, []).append(1e3 * res[0] / res[3])
                round_trips.append(actor_round_trip_ms())
            reference = results["in-process"][2]
            for layout, (secs, _, tokens, steps, phases) in results.items():
                rows.append({
                    "batch": batch,
                    "layout": layout,
                    "ms_per_step": 1e3 * secs / steps,
                    "cpu_ms_per_step": 1e3 * least_cpu[layout],
                    "tokens_per_s": sum(len(t) for t in tokens) / secs,
                    "steps": steps,
                    "draft_ms_per_step": 1e3 * phases["propose"] / max(phases["steps"], 1),
                    "verify_ms_per_step": 1e3 * phases["verify"] / max(phases["steps"], 1),
                    "identical_to_in_process": tokens == reference,
                    "ms_per_step_runs": [round(x, 2) for x in runs[layout]],
                    "actor_round_trip_ms": min(round_trips),
                })
    finally:
        ray.shutdown()
    colocated = {r["batch"]: r for r in rows if r["layout"] == "colocated actor"}
    waits = {(r["batch"], r["layout"]): r["draft_ms_per_step"] for r in rows}
    for r in rows:
        r["vs_colocated"] = r["ms_per_step"] / colocated[r["batch"]]["ms_per_step"]
        r["cpu_vs_colocated"] = r["cpu_ms_per_step"] / colocated[r["batch"]]["cpu_ms_per_step"]
        if r["layout"] == "separate, overlap":
            off = waits[(r["batch"], "separate, no overlap")]
            r["draft_wait_recovered"] = round(1 - r["draft_ms_per_step"] / off, 3) if off > 0 else None
    _report(rows, pathlib.Path(args.out))
    return 0 if all(r["identical_to_in_process"] for r in rows) else 1


def _report(rows: list[dict], out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    header = (f"{'batch':>5}  {'layout':<21} {'ms/step':>8} {'tok/s':>8} {'steps':>6} {'x colocated':>11} "
              f"{'cpu ms/step':>11} {'cpu x coloc':>11} {'draft ms':>8} {'verify ms':>9} {'recovered':>9}  identical  "
              "ms/step of each run (least-most)")
    print(header)
    for r in rows:
        rec = r.get("draft_wait_recovered")
        spread = "-".join(f"{x:.1f}" for x in (min(r["ms_per_step_runs"]), max(r["ms_per_step_runs"])))
        print(f"{r['batch']:>5}  {r['layout']:<21} {r['ms_per_step']:>8.2f} {r['tokens_per_s']:>8.1f} "
              f"{r['steps']:>6} {r['vs_colocated']:>11.2f} {r['cpu_ms_per_step']:>11.2f} {r['cpu_vs_colocated']:>11.2f} "
              f"{r['draft_ms_per_step']:>8.2f} {r['verify_ms_per_step']:>9.2f} "
              f"{'' if rec is None else f'{rec:.2f}':>9}  {r['identical_to_in_process']!s:<9}  {spread}")
    for batch in dict.fromkeys(r["batch"] for r in rows):
        coloc = next(r for r in rows if r["batch"] == batch and r["layout"] == "colocated actor")
        rtt = coloc["actor_round_trip_ms"]
        print(f"batch {batch}: one actor call's round trip {rtt:.2f} ms (the least of the repeats' medians) = "
              f"{rtt / coloc['ms_per_step']:.0%} of a colocated step; a separate-layout step waits for one, its draft worker's, "
              "unless overlap drafted the step ahead")
    with open(out / "actors.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    (out / "actors.json").write_text(json.dumps(rows, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(layouts)
    for i, layout in enumerate(layouts):
        vals = [next(r["ms_per_step"] for r in rows if r["batch"] == b and r["layout"] == layout) for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], vals, width, label=layout)
    ax.set_xticks([j + width * (len(layouts) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("ms per speculative step")
    ax.set_title("specray: actor layouts, demo pair, draft k=3")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "actors.png", dpi=120)
    print(f"wrote {out / 'actors.csv'}, {out / 'actors.json'}, {out / 'actors.png'}")


if __name__ == "__main__":
    sys.exit(main())
