"""Online learning on a live server: ``specray serve --online-learning`` as users start it,
under continuous HTTP load, learning off against on over the same requests.

    python -m specray.bench.online --live [--requests 300] [--concurrency 4] [--max-tokens 32]
                                          [--window 30] [--config FILE] [--out bench/results]

Each side starts ``specray serve`` (the demo pair, a local Ray on this machine's real cores,
the server's own defaults; ``--online-learning`` on the second side; ``--config`` adds a serve
config to both) and serves the shifted workload (``bench/shifted.py``: text the demo pair never
saw) through ``/v1/completions``, ``--concurrency`` requests in flight at all times, greedy, the
draft model at a fixed k (``SPEC``: the self-tuning length would mix CPU-timing noise into the
acceptance). Training runs in the server's trainer actor, asynchronously, while requests are
served. The learning side's ``GET /v1/drafters`` gives each round's start, end and gate decision;
they are placed against the requests finished by then. Prints the curve — mean accepted length
per step over each window of ``--window`` requests — the rounds, and the gain over the requests
served after the first published version; writes online-live.{json,png} to ``--out``.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

SPEC = {"method": "draft", "num_speculative_tokens": 5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """``specray serve`` in a session of its own, read until it says ready; its output kept."""

    def __init__(self, argv: list[str], log: pathlib.Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        cmd = [sys.executable, "-m", "specray.entrypoints.cli", "serve", "--port", str(self.port), *argv]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self._keep(line)
            if "specray: ready" in line:
                break
        if self.proc.poll() is not None:
            raise RuntimeError("specray serve did not start:\n" + "".join(self.lines[-30:]))
        self._reader = threading.Thread(target=lambda: [self._keep(x) for x in self.proc.stdout], daemon=True)
        self._reader.start()

    def _keep(self, line: str) -> None:
        self.lines.append(line)
        self.log.write(line)
        self.log.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=10)
        self.log.close()


def serve_workload(server: Server, prompts: list[str], args, learning: bool) -> dict:
    """Every prompt through HTTP, ``--concurrency`` in flight; (finish time, metrics) per request."""
    rows: list[dict | None] = [None] * len(prompts)
    done: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = {"model": model, "prompt": prompts[i], "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "speculation": SPEC}
        reply = _http(f"{server.url}/v1/completions", body)
        m = reply["speculation_metrics"][0]
        with lock:
            done.append(time.time())
            rows[i] = {"finished": done[-1], "drafts": m["num_drafts"], "accepted": m["num_accepted_tokens"],
                       "version": m.get("drafter_version"), "text": reply["choices"][0]["text"]}

    model = _http(f"{server.url}/v1/models")["data"][0]["id"]
    start = time.time()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(lambda i: one(i), range(len(prompts))))
    status = _http(f"{server.url}/v1/drafters") if learning else None
    return {"rows": rows, "seconds": time.time() - start, "status": status, "started": start}


def requests_by(rows: list[dict], t: float | None) -> int | None:
    """Requests finished by time ``t``."""
    return None if t is None else sum(r["finished"] <= t for r in rows)


def curve(rows: list[dict], window: int) -> list[float]:
    out = []
    for lo in range(0, len(rows), window):
        part = rows[lo:lo + window]
        out.append(round(1 + sum(r["accepted"] for r in part) / max(sum(r["drafts"] for r in part), 1), 3))
    return out


def run(args) -> int:
    from specray.bench.shifted import shifted_prompts

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = shifted_prompts(args.requests, args.seed)
    extra = ["--config", args.config] if args.config else []
    sides = {}
    for learning in (False, True):
        name = "on" if learning else "off"
        server = Server([*extra, *(["--online-learning"] if learning else [])], out / f"online-live-{name}.log")
        try:
            sides[name] = serve_workload(server, prompts, args, learning)
        finally:
            server.stop()
        sides[name]["server_lines"] = [x.rstrip() for x in server.lines if x.startswith("specray: online learning")]
    off, on = sides["off"], sides["on"]
    by_finish = sorted(on["rows"], key=lambda r: r["finished"])
    rounds = [{"method": r["method"], "started_after_request": requests_by(by_finish, r.get("started")),
               "ended_after_request": requests_by(by_finish, r["time"]),
               "decision": r["version"] and f"published {r['version']}" or f"kept {r.get('kept')}",
               "candidate": r.get("candidate", {}).get("mean_accepted_length"),
               "serving": r.get("serving", {}).get("mean_accepted_length"), "seconds": r.get("seconds"),
               "traces": r.get("train_traces"), "error": r.get("error")} for r in on["status"]["rounds"]]
    first = next((r["ended_after_request"] for r in rounds if r["decision"].startswith("published")), None)
    # Requests in the order they finished: the ones after the first publish could be served by it.
    order = sorted(range(len(prompts)), key=lambda i: on["rows"][i]["finished"])
    after = order[first:] if first is not None else []
    gain = None
    if after:
        def mean(side):
            rows = [side["rows"][i] for i in after]
            return 1 + sum(r["accepted"] for r in rows) / max(sum(r["drafts"] for r in rows), 1)
        gain = {"off": round(mean(off), 3), "on": round(mean(on), 3), "requests": len(after)}
    same = [r["text"] for r in off["rows"]] == [r["text"] for r in on["rows"]]
    report = {"args": vars(args), "spec": SPEC, "curve_off": curve(off["rows"], args.window),
              "curve_on": curve(on["rows"], args.window), "rounds": rounds, "first_published_after_request": first,
              "after_first_publish": gain, "identical_text": same, "seconds": {"off": round(off["seconds"], 1),
                                                                                "on": round(on["seconds"], 1)},
              "trainer": on["status"]["trainer"].get("placement"), "server_lines": on["server_lines"],
              "load_average": os.getloadavg()}
    print(f"specray serve --online-learning, {args.requests} requests, {args.concurrency} in flight, "
          f"{json.dumps(SPEC)}; trainer: {(report['trainer'] or {}).get('message')}")
    print(f"{'requests':>10} {'off':>7} {'on':>7} {'gain':>7}")
    for i, (a, b) in enumerate(zip(report["curve_off"], report["curve_on"])):
        print(f"{min((i + 1) * args.window, args.requests):>10} {a:>7.3f} {b:>7.3f} {b / a - 1:>+7.1%}")
    print(f"\n{'round':>5} {'method':>7} {'started after':>14} {'ended after':>12} {'candidate':>10} "
          f"{'serving':>8} {'s':>5}  decision")
    for n, r in enumerate(rounds, 1):
        print(f"{n:>5} {r['method']:>7} {str(r['started_after_request']):>14} {str(r['ended_after_request']):>12} "
              f"{r['candidate'] or 0:>10.3f} {r['serving'] or 0:>8.3f} {r['seconds'] or 0:>5.0f}  "
              f"{r['error'] or r['decision']}")
    if gain:
        print(f"\nthe {gain['requests']} requests finished after the first published version: mean accepted "
              f"length off {gain['off']:.3f}, on {gain['on']:.3f} ({gain['on'] / gain['off'] - 1:+.1%})")
    else:
        print("\nno version was published")
    print(f"identical text: {same}; serving time off {report['seconds']['off']} s, on {report['seconds']['on']} s")
    (out / "online-live.json").write_text(json.dumps(report, indent=2))
    _plot(report, args, out / "online-live.png")
    print(f"wrote {out / 'online-live.json'} and {out / 'online-live.png'}")
    return 0 if same else 1


def _plot(report: dict, args, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    x = [min((i + 1) * args.window, args.requests) for i in range(len(report["curve_off"]))]
    ax.plot(x, report["curve_off"], "o-", color="#888", label="learning off")
    ax.plot(x, report["curve_on"], "o-", color="#2a7", label="learning on")
    for r in report["rounds"]:
        if r["decision"].startswith("published") and r["ended_after_request"] is not None:
            ax.axvline(r["ended_after_request"], color="#2a7", lw=0.6, ls=":")
    ax.set_xlabel("requests served")
    ax.set_ylabel("mean accepted length per step")
    ax.set_title("specray serve --online-learning (dotted: a version published)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
