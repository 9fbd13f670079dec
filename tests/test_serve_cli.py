"""`specray serve` as a process: safe to leave running, and one's own checkpoint with one flag.

Each test starts the real command (a local Ray of its own, the demo pair or a copy of its
target with the tokenizer beside it) and stops it by signal, checking that it exits 0 within
10 s, frees its port and leaves no process behind. `--once` (one request, then stop) is the
README's main job, which CI runs as written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specray.entrypoints.processes import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SPECRAY = [sys.executable, "-m", "specray.entrypoints.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(pids: list[int]) -> list[str]:
    """Local addresses the processes listen on (TCP)."""
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    return [ln.split()[3] for ln in lines if any(f"pid={p}," in ln for p in pids)]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def post(url: str, body: dict) -> tuple[float, dict]:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        reply = json.loads(r.read())
    return time.perf_counter() - start, reply


def as_users_start() -> dict:
    """This process's environment without the suite's own settings (tests/conftest.py: no
    start-up cost profile), so the command runs as a user's does."""
    return {k: v for k, v in os.environ.items() if k != "SPECRAY_PROFILE_COSTS"}


class Server:
    """`specray serve ...` in its own session, read until it says ready."""

    def __init__(self, *argv: str, env: dict | None = None):
        self.proc = subprocess.Popen([*SPECRAY, "serve", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True,
                                     env={**as_users_start(), "PYTHONUNBUFFERED": "1", **(env or {})})
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if "specray: ready" in line:
                break
        assert self.proc.poll() is None, "".join(self.lines)
        self.family = descendants(self.proc.pid)

    def __enter__(self) -> "Server":
        return self

    def wait_for(self, text: str) -> list[str]:
        """Read the server's output until a line contains ``text`` (a readiness wait: the test's
        timeout bounds it); the lines that do."""
        for line in self.proc.stdout:
            self.lines.append(line)
            if text in line:
                break
        return [line for line in self.lines if text in line]

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # a failed test: take down what it started (its own group)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate(timeout=30)

    def stop(self, sig) -> tuple[int, float, str]:
        start = time.monotonic()
        if sig is not None:
            self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode, time.monotonic() - start, "".join(self.lines) + out


def assert_clean_exit(server: Server, sig, port: int) -> str:
    """Signal ``sig`` (None: one already sent): exit 0 soon, the port free, nothing left
    running, no crash in the output (returned)."""
    code, _, output = server.stop(sig)  # a hang fails there (the wait is bounded)
    assert code == 0, (code, output[-2000:])
    assert port_free(port)
    assert not [p for p in server.family if alive(p)], "processes left behind"
    for word in ("Traceback", "Aborted", "core dumped", "graceful_shutdown failed", "*** SIG"):
        assert word not in output, output[-3000:]
    return output


@pytest.fixture(scope="module")
def own_checkpoint(tmp_path_factory, demo_pair) -> str:
    root = tmp_path_factory.mktemp("user") / "my-coder"
    shutil.copytree(demo_pair.target, root)
    for f in Path(demo_pair.tokenizer).iterdir():
        if f.is_file():
            shutil.copy(f, root / f.name)
    return str(root)


def test_busy_port_is_an_error_before_anything_starts(demo_pair):
    port = free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        done = subprocess.run([*SPECRAY, "serve", "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "ready" not in done.stdout
    assert "Started a local Ray" not in done.stderr


def test_demo_server_learns_online_and_stops_on_sigint(demo_pair, tmp_path):
    """`specray serve --online-learning` as the docs start it, on this machine's real cores: ready
    once warm-up requests were answered, a local Ray on loopback only, the trainer placed (said
    at start-up), a training round run on served traffic and its gate decision printed; SIGINT
    ends it all cleanly (SIGTERM: the draining test below). Rounds are small (a config file)."""
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text("online_learning:\n  round_requests: 8\n  steps: 10\n")
    with Server("--port", str(port), "--online-learning", "--config", str(config)) as server:
        output = "".join(server.lines)
        for word in ("device cpu", "dtype float32", "attention sdpa", "at most 8 sequences", "methods: draft",
                     "tensor parallel size 1"):
            assert word in output, output
        warm = output.index("specray: warm: ")
        assert warm < output.index("specray: ready") and "requests answered" in output[warm:]
        assert warm < output.index("specray: online learning: the trainer is up (") < output.index("specray: ready")
        addresses = listening(server.family)
        assert addresses and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in addresses), addresses
        url = f"http://127.0.0.1:{port}/v1/completions"
        prompts = ["class Stack:\n    def push(self, item):", "import os\n", "def add(a, b):", "for i in range("]
        for i in range(12):  # each a trace of the draft model (at least min_tokens long)
            _, reply = post(url, {"model": "specray-demo", "prompt": prompts[i % 4] + " " * (i // 4), "max_tokens": 24,
                                  "temperature": 0, "ignore_eos": True})
            assert reply["speculation_metrics"][0]["method"] == "draft"  # the default, with a draft loaded
        lines = server.wait_for("specray: online learning: round of draft on ")
        assert lines[-1].rstrip().endswith(")") and (" published draft@" in lines[-1] or " kept draft@" in lines[-1])
        said = "".join(server.lines)
        assert "specray: online learning: the trainer holds CPU" in said or "no reservation" in said, said
        assert_clean_exit(server, signal.SIGINT, port)


def sse_lines(url: str, body: dict, into: list, first) -> None:
    """Read a streamed completion's events into ``into`` (``first`` set at the first one)."""
    import urllib.request

    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: "):
                into.append(line[len("data: "):])
                first.set()


@pytest.mark.timeout(900)
def test_own_checkpoint_at_tensor_parallel_size_2_and_sigterm_drains(own_checkpoint, demo_engine, demo_models):
    """--target DIR split over two ranks (a local Ray of its own, no GPUs: the ranks take CPU
    bundles, gloo): named after the directory, prompt lookup by default, the greedy text of
    plain decoding (itself Hugging Face's). SIGTERM: new requests get 503, a request that
    finishes within --graceful-shutdown-s finishes, one that does not ends with an error event;
    then a clean exit 0. (One server for all of it: each start is a Ray, Serve and the model's
    ranks, minutes on CI's shared cores; `--once` is the README's main job, run by CI.)"""
    import threading
    import urllib.error
    import urllib.request

    from specray.engine import SamplingParams, SpeculationParams
    from tests.conftest import hf_greedy

    port = free_port()
    # A Ray of its own, whatever other clusters this machine runs ("local": never join one).
    env = {"SPECRAY_WORKER_THREADS": "1", "RAY_ADDRESS": "local"}
    with Server("--target", own_checkpoint, "--tensor-parallel-size", "2", "--port", str(port),
                "--graceful-shutdown-s", "8", env=env) as server:
        said = "".join(server.lines)
        assert "serving 'my-coder'" in said and "tensor parallel size 2" in said, said
        url = f"http://127.0.0.1:{port}/v1/completions"
        prompt = "def fibonacci(n):"
        _, reply = post(url, {"model": "my-coder", "prompt": prompt, "max_tokens": 48, "temperature": 0})
        assert reply["model"] == "my-coder" and reply["usage"]["completion_tokens"] == 48
        assert reply["speculation_metrics"][0]["method"] == "ngram"
        ref = demo_engine(max_num_seqs=1).generate([prompt], SamplingParams(max_tokens=48, temperature=0),
                                                   SpeculationParams(method="none"))[0]
        target, _, tok = demo_models
        hf = hf_greedy(target, tok.encode(prompt, add_special_tokens=False), 48)
        assert ref.token_ids[: len(hf)] == hf[: len(ref.token_ids)]
        assert reply["choices"][0]["text"] == ref.text
        body = {"model": "my-coder", "prompt": "def f(x):", "temperature": 0, "ignore_eos": True,
                "speculation": {"method": "none"}}
        short, long, threads = [], [], []
        # 4 choices of 1,900 tokens: many seconds of steps at TP 2, well past the grace period;
        # then 24 tokens, in flight when the signal comes and well inside the period.
        for events, extra in ((long, {"max_tokens": 1900, "n": 4}), (short, {"max_tokens": 24})):
            first = threading.Event()
            threads.append(threading.Thread(target=sse_lines, args=(url, {**body, **extra}, events, first),
                                            daemon=True))
            threads[-1].start()
            assert first.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 120
        while refused is None and time.monotonic() < deadline:
            try:
                post(url, {**body, "max_tokens": 1})
            except urllib.error.HTTPError as exc:
                refused = exc
            time.sleep(0.2)
        assert refused is not None and refused.code == 503, refused
        assert json.loads(refused.read())["error"]["type"] == "shutting_down"
        for t in threads:
            t.join(60)
        assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
        error = json.loads(long[-1])["error"]
        assert error["type"] == "shutting_down" and error["code"] == 503, long[-3:]
        # The grace period is over (the long stream ended): then the same clean exit as SIGINT's.
        assert "ending 1 requests still in flight" in assert_clean_exit(server, None, port)
