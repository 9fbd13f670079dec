"""Engine replicas autoscaling on fake GPUs under sustained load, on the tiny random pair
(token-id prompts). ``serve run`` of examples/serve.yaml is tests/test_cluster.py's."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from specray.entrypoints.app import build_app  # noqa: E402

pytestmark = pytest.mark.timeout(420)

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
