"""The engine deployment: each replica owns a coordinator and its workers."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from specray.actors.coordinator import CoordinatorCore
from specray.serve.config import ServeConfig
from specray.serve.metrics import EngineMetrics

log = logging.getLogger(__name__)


_END = object()  # end of a request's outputs


def _detached(coro) -> asyncio.Task:
    """A task in a fresh context: remote calls it makes are not children of the request
    being served (Ray cancels a cancelled request's children recursively)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


REFUSED = "refused"  # the key of a refusal (outputs have an "error" field of their own)


def client_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict:
    """What ``stream`` yields instead of outputs when a request is refused (the ingress answers
    it with that status in OpenAI's shape)."""
    return {REFUSED: {"status": status, "message": message, "kind": kind, "param": param}}


class EngineDeployment:
    """Async generator API for the ingress: ``stream(prompt, sampling, speculation)`` yields the
    engine's step deltas (``engine/delta.py``) as the coordinator passes them on, or a refusal."""

    def __init__(self, config: dict):
        cfg = ServeConfig.model_validate(config)
        self.max_waiting = cfg.max_queued_requests
        self.max_num_seqs = cfg.engine.max_num_seqs
        self._inflight = 0  # requests admitted to this replica and not yet done
        self.core = CoordinatorCore(cfg.engine)
        self.metrics = EngineMetrics(cfg.model_name)

    async def stream(self, prompt, sampling: dict, speculation: dict | None):
        # Started outside the request's context too (see below): the workers must not be
        # children of whichever request happened to come first.
        await asyncio.shield(_detached(self.core.start()))
        waiting, _ = self._load()
        if waiting >= self.max_waiting:
            # Refusals travel as values: an exception here would be logged by Serve with a traceback.
            yield client_error(503, f"server busy: {self.max_waiting} requests already waiting", "overloaded")
            return
        self._inflight += 1
        # The coordinator's work for this request (its submit, which may start the step
        # loop, and the abort if the client goes away) runs in a task with a fresh
        # context. In a Serve replica, Ray records the *request* as the parent of any
        # remote call made from its context (copied into tasks it creates), and a client
        # disconnect cancels the request's children recursively: the shared step loop's
        # in-flight call would be cancelled and every request on the replica fail.
        outputs: asyncio.Queue = asyncio.Queue()
        pump = _detached(self._pump(prompt, sampling, speculation, outputs))
        start = last = time.monotonic()
        first, generated = True, 0
        prompt_tokens = 0 if isinstance(prompt, str) else len(prompt)
        try:
            while True:
                out = await outputs.get()
                if out is _END:
                    break
                if isinstance(out, ValueError):  # the request is bad: a 400, not a failure
                    yield client_error(400, str(out).split("\n\n")[0].strip(), param=getattr(out, "param", None))
                    return
                if isinstance(out, BaseException):
                    raise out
                now = time.monotonic()
                generated += len(out["new_token_ids"])
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
                    self.metrics.finished(out, prompt_tokens, generated)
                self.metrics.load(*self._load())
                yield out
        finally:
            self._inflight -= 1
            if not pump.done():
                pump.cancel()  # the coordinator's stream aborts the request, in the pump's context

    async def _pump(self, prompt, sampling, speculation, outputs: asyncio.Queue) -> None:
        try:
            async for out in self.core.stream(prompt, sampling, speculation):
                outputs.put_nowait(out)
            outputs.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised in the request's own task
            outputs.put_nowait(exc)

    async def drafters(self, action: str, args: dict) -> dict:
        """Online learning's operations (``CoordinatorCore.drafters``)."""
        await asyncio.shield(_detached(self.core.start()))
        return await self.core.drafters(action, **args)

    def _load(self) -> tuple[int, int]:
        """(waiting, running) requests of this replica. Counted here: with a colocated
        worker the queue lives in that actor, not in ``self.core.scheduler``."""
        return max(0, self._inflight - self.max_num_seqs), min(self._inflight, self.max_num_seqs)

    async def __del__(self):
        try:
            await self.core.shutdown()
        except Exception:  # the cluster may already be gone
            pass
