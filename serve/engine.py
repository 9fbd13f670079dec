"""The engine deployment: each replica owns a coordinator and its workers."""

from __future__ import annotations

import logging
import time

from specray.actors.coordinator import CoordinatorCore
from specray.serve.config import ServeConfig
from specray.serve.metrics import EngineMetrics

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """The replica's bounded queue is full (HTTP 503)."""


class EngineDeployment:
    """Async generator API for the ingress: ``stream(prompt, sampling, speculation)``."""

    def __init__(self, config: dict):
        cfg = ServeConfig.model_validate(config)
        self.model_name = cfg.model_name
        self.max_waiting = cfg.max_queued_requests
        self.core = CoordinatorCore(cfg.engine)
        self.metrics = EngineMetrics(cfg.model_name)

    async def limits(self) -> dict:
        await self.core._start()
        lim = self.core.scheduler.limits
        return {"capacity": lim.capacity, "vocab_size": lim.vocab_size}

    async def stream(self, prompt, sampling: dict, speculation: dict | None):
        await self.core._start()
        if len(self.core.scheduler.waiting) >= self.max_waiting:
            raise Overloaded(f"server busy: {self.max_waiting} requests already waiting")
        start = last = time.monotonic()
        first = True
        async for out in self.core.stream(prompt, sampling, speculation):
            now = time.monotonic()
            if out["new_token_ids"]:
                if first:
                    self.metrics.ttft.observe(now - start, self.metrics.tags)
                    first = False
                else:
                    # One observation per token: tokens accepted together arrive together.
                    per_token = (now - last) / len(out["new_token_ids"])
                    for _ in out["new_token_ids"]:
                        self.metrics.itl.observe(per_token, self.metrics.tags)
                last = now
            if out["finished"]:
                self.metrics.finished(out)
            self.metrics.load(len(self.core.scheduler.waiting), len(self.core.scheduler.running))
            yield out

    async def check_health(self) -> None:
        """Serve's health check: a replica whose coordinator failed to start is unhealthy."""
        if self.core.placement is None and self.core._started:
            raise RuntimeError("coordinator lost its placement")

    async def __del__(self):
        try:
            await self.core.shutdown()
        except Exception:  # the cluster may already be gone
            pass
