"""The longer Serve tests: engine replicas autoscaling on fake GPUs under sustained load,
and ``serve run`` of a YAML shaped like ``examples/serve.yaml`` in a Ray of its own.

Both use the tiny random pair (token-id prompts); neither needs the demo pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from tests.conftest import free_port  # noqa: E402
from specray.entrypoints.app import build_app  # noqa: E402

pytestmark = pytest.mark.timeout(420)

REPO = pathlib.Path(__file__).resolve().parents[1]
ENGINE = "SpecrayEngine"


def running_replicas(app: str) -> int:
    status = serve.status().applications.get(app)
    if status is None or ENGINE not in status.deployments:
        return 0
    return status.deployments[ENGINE].replica_states.get("RUNNING", 0)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(interval)


class Load:
    """``concurrency`` clients each streaming long completions back to back, in a thread,
    until stopped or ``cap_s`` passes (bounded whatever happens to the test)."""

    def __init__(self, url: str, body: dict, concurrency: int, cap_s: float):
        self.url, self.body, self.concurrency, self.cap_s = url, body, concurrency, cap_s
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "load generator did not stop"

    async def _client(self, c: httpx.AsyncClient, deadline: float) -> None:
        while not self._stop.is_set() and time.monotonic() < deadline:
            try:
                async with c.stream("POST", self.url, json=self.body) as r:
                    async for _ in r.aiter_lines():
                        pass
                    self.statuses.append(r.status_code)
            except httpx.HTTPError as e:  # recorded; the test asserts there are none
                self.errors.append(repr(e))

    async def _run(self) -> None:
        deadline = time.monotonic() + self.cap_s
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(self._client(c, deadline) for _ in range(self.concurrency)))


def test_replicas_scale_up_under_load_and_back_down(server, tiny_checkpoints):
    """Colocated engines (one fake GPU each), 1 -> 2 replicas under 6 concurrent streams,
    back to 1 when the load stops; no request fails meanwhile; the GPU is given back."""
    cfg = {
        "model_name": "tiny-autoscale",
        "engine": {**tiny_checkpoints, "max_num_seqs": 4, "placement": {"mode": "colocated"}},
        "autoscaling": {
            "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
            "upscale_delay_s": 0, "downscale_delay_s": 2, "metrics_interval_s": 0.5, "look_back_period_s": 1,
        },
    }
    serve.run(build_app(cfg), name="autoscale", route_prefix="/autoscale")
    url = f"{server}/autoscale/v1/completions"
    try:
        assert running_replicas("autoscale") == 1
        body = {"model": "tiny-autoscale", "prompt": [1, 2, 3], "max_tokens": 240, "temperature": 0,
                "stream": True, "speculation": {"method": "draft", "num_speculative_tokens": 2}}
        assert httpx.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=120).status_code == 200
        gpus = ray.cluster_resources()["GPU"]
        t0 = time.monotonic()
        with Load(url, body, concurrency=6, cap_s=90) as load:
            wait_for(lambda: running_replicas("autoscale") == 2, 60, "scale up to 2 replicas")
            up = time.monotonic() - t0
            # Both replicas serve: requests keep completing after the second one is up.
            served = len(load.statuses)
            wait_for(lambda: len(load.statuses) >= served + 6, 60, "requests completing on 2 replicas")
        assert load.errors == [] and set(load.statuses) == {200}, (load.errors[:3], set(load.statuses))
        t1 = time.monotonic()
        wait_for(lambda: running_replicas("autoscale") == 1, 60, "scale down to 1 replica")
        print(f"\n2 replicas {up:.1f}s after the load began; 1 replica {time.monotonic() - t1:.1f}s after it "
              f"stopped; {len(load.statuses)} streams served, all 200")
        # The stopped replica's coordinator gave its placement group (its GPU) back.
        wait_for(lambda: ray.available_resources().get("GPU", 0) >= gpus - 1, 30, "GPU released")
        assert httpx.post(url, json={**body, "stream": False, "max_tokens": 4}, timeout=120).json()[
            "usage"]["completion_tokens"] == 4
    finally:
        serve.delete("autoscale")


# -- serve run <yaml> --------------------------------------------------------------------------
def _serve_executable() -> list[str]:
    exe = pathlib.Path(sys.executable).with_name("serve")
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "from ray.serve.scripts import cli; cli()"]


def _pids_with_env(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (our private RAY_TMPDIR): the `serve
    run` process and everything its Ray started, workers included (they leave the
    process group, and retitle themselves, but keep the environment)."""
    needle = marker.encode()
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _stop(proc: subprocess.Popen, marker: str) -> list[int]:
    """SIGINT (serve run shuts Serve and its own Ray down), then SIGKILL whatever of ours
    is left, by pid. Never `ray stop`: other Rays run on this machine."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    # Alone, serve run is down well within this; beside the rest of the suite it never was in
    # 65 s (24 leftovers in both whole-suite runs here), so waiting longer only costs CI time.
    try:
        proc.wait(timeout=25)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 10
    while _pids_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    # SIGKILL what is left until nothing is: in two whole-suite runs on one machine, one of 24
    # leftovers was still listed right after a single round of kills (still being torn down, or
    # forked by a daemon as the others died).
    killed: set[int] = set()
    deadline = time.monotonic() + 30
    while (left := _pids_with_env(marker)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed.update(left)
        time.sleep(0.2)
    proc.wait(timeout=30)
    return sorted(killed)


@contextlib.contextmanager
def serve_run(config: pathlib.Path, tmp_path: pathlib.Path, port: int):
    """``serve run CONFIG`` in a Ray of its own (private RAY_TMPDIR: it would otherwise join the
    newest cluster recorded under /tmp/ray), answering /v1/models on ``port`` when this yields
    its base URL; stopped by SIGINT (then SIGKILL by pid for leftovers) on the way out."""
    ray_tmp = tempfile.mkdtemp(prefix="sr-", dir="/tmp")  # short: unix socket paths are limited
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_NAMESPACE")}
    marker = f"RAY_TMPDIR={ray_tmp}"
    env.update(RAY_TMPDIR=ray_tmp, SPECRAY_WORKER_THREADS="1", HF_HUB_OFFLINE="1")
    log_path = tmp_path / "serve-run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*_serve_executable(), "run", str(config)], cwd=tmp_path, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        def models_answer() -> bool:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                return httpx.get(f"{base}/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(models_answer, 150, "serve run answering /v1/models", interval=1)
        assert len(_pids_with_env(marker)) > 3  # serve run, its Ray's daemons and workers
        yield base
    finally:
        killed = _stop(proc, marker)
        print(f"serve run stopped by SIGINT; {len(killed)} leftover process(es) needed SIGKILL")
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not _pids_with_env(marker)


@pytest.mark.slow  # starts processes
@pytest.mark.timeout(300)
def test_serve_run_yaml_in_its_own_ray(tmp_path, tiny_checkpoints):
    """examples/serve.yaml's layout, pointed at the tiny pair and a free port, through the
    `serve run` CLI."""
    doc = yaml.safe_load((REPO / "examples" / "serve.yaml").read_text())
    port = free_port()
    doc["http_options"]["port"] = port
    (app,) = doc["applications"]
    engine = app["args"]["engine"]
    engine.update(target=tiny_checkpoints["target"], draft=tiny_checkpoints["draft"])
    engine["placement"]["target"] = {"num_cpus": 0.5}  # fits a 1-2 CPU machine
    model = app["args"]["model_name"]
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(doc))

    with serve_run(config, tmp_path, port) as base:
        assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == model
        body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 8, "temperature": 0,
                "speculation": {"method": "draft", "num_speculative_tokens": 3}}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8 and r.json()["speculation_metrics"][0]["num_drafts"] > 0
        # The tiny checkpoints have no tokenizer, hence no chat template: a clear 400.
        chat = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
