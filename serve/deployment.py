"""The engine deployment: each replica owns a coordinator and its workers."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from specray.actors.coordinator import CoordinatorCore, StartError
from specray.engine.admission import Decision, Load, RequestCost
from specray.serve.config import ServeConfig
from specray.serve.metrics import EngineMetrics

log = logging.getLogger(__name__)


_END = object()  # end of a request's outputs


def _detached(coro) -> asyncio.Task:
    """A task in a fresh context: remote calls it makes are not children of the request
    being served (Ray cancels a cancelled request's children recursively)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())


REFUSED = "refused"  # the key of a refusal (outputs have an "error" field of their own)
START_FAILED = "engine_start_failed"  # the error type of a replica whose workers could not start


def client_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 retry_after_s: float | None = None) -> dict:
    """What ``run`` yields instead of outputs when a request is refused (the ingress answers
    it with that status in OpenAI's shape, and ``Retry-After`` when given)."""
    return {REFUSED: {"status": status, "message": message, "kind": kind, "param": param,
                      "retry_after_s": retry_after_s}}


def refusal(decision: Decision) -> dict:
    return client_error(decision.status, decision.message, decision.kind, decision.param, decision.retry_after_s)


class EngineDeployment:
    """Async generator API for the ingress: ``run(prompts, samplings, speculation)`` runs one
    request whole — every choice of every prompt — and yields the engine's step deltas
    (``engine/delta.py``), each with its choice's ``index``, or one refusal.

    One call per request, so Serve's queue counts requests (never half of one), and the
    replica's admission policy (``engine/admission.py``) takes or refuses it whole.
    """

    def __init__(self, config: dict):
        cfg = ServeConfig.model_validate(config)
        self.admission = cfg.admission_policy()
        self.max_num_seqs = cfg.engine.max_num_seqs
        self._inflight = 0  # sequences admitted to this replica and not yet done
        self.core = CoordinatorCore(cfg.engine)
        self.metrics = EngineMetrics(cfg.model_name)

    async def run(self, prompts: list, samplings: list[list[dict]], speculation: dict | None, param: str = "prompt"):
        """prompts[i] (text or token ids) runs once per sampling in samplings[i]; choice index
        = the position in that flattened order (OpenAI's prompt x n + j)."""
        # Started outside the request's context too (see below): the workers must not be
        # children of whichever request happened to come first.
        try:
            await asyncio.shield(_detached(self.core.start()))
        except StartError as exc:  # this replica cannot serve: every request says why
            yield client_error(500, str(exc), START_FAILED)
            return
        items = [(prompt, s, speculation, None) for prompt, choices in zip(prompts, samplings) for s in choices]
        sizes = [0 if isinstance(prompt, str) else len(prompt) for prompt, _, _, _ in items]
        decision = self.admission.admit(RequestCost(len(items), sum(sizes)), Load(*self._load()), param)
        if not decision.admitted:
            # Refusals travel as values: an exception here would be logged by Serve with a traceback.
            yield refusal(decision)
            return
        self._inflight += len(items)
        # The coordinator's work for this request (its submit, which may start the step
        # loop, and the aborts if the client goes away) runs in a task with a fresh
        # context. In a Serve replica, Ray records the *request* as the parent of any
        # remote call made from its context (copied into tasks it creates), and a client
        # disconnect cancels the request's children recursively: the shared step loop's
        # in-flight call would be cancelled and every request on the replica fail.
        outputs: asyncio.Queue = asyncio.Queue()
        pump = _detached(self._pump(items, outputs))
        start = time.monotonic()
        last = [start] * len(items)
        generated = [0] * len(items)
        unfinished = len(items)
        try:
            while unfinished:
                item = await outputs.get()
                if isinstance(item, ValueError):  # the request is bad: a 400, not a failure
                    yield client_error(400, str(item).split("\n\n")[0].strip(), param=getattr(item, "param", None))
                    return
                if isinstance(item, BaseException):
                    raise item
                index, out = item
                now = time.monotonic()
                if out["new_token_ids"]:
                    if not generated[index]:
                        self.metrics.ttft.observe(now - start, self.metrics.tags)
                    else:
                        # One observation per token: tokens accepted together arrive together.
                        per_token = (now - last[index]) / len(out["new_token_ids"])
                        for _ in out["new_token_ids"]:
                            self.metrics.itl.observe(per_token, self.metrics.tags)
                    generated[index] += len(out["new_token_ids"])
                    last[index] = now
                if out["finished"]:
                    self.metrics.finished(out, sizes[index], generated[index])
                    unfinished -= 1
                    self._inflight -= 1
                self.metrics.load(*self._load(), self.core.kv, self.core.budget)
                yield {**out, "index": index}
        finally:
            self._inflight -= unfinished
            self.metrics.load(*self._load(), self.core.kv)  # idle again: the gauges say so
            if not pump.done():
                pump.cancel()  # aborts the request's unfinished sequences, in the pump's context

    async def _pump(self, items: list, outputs: asyncio.Queue) -> None:
        finished: set[int] = set()
        reqs = []
        try:
            reqs = await self.core.submit_all(items)

            async def follow(index: int, rid: str) -> None:
                async for out in self.core.outputs(rid):
                    if out["finished"]:
                        finished.add(index)
                    outputs.put_nowait((index, out))

            await asyncio.gather(*(follow(i, r.request_id) for i, r in enumerate(reqs)))
        except BaseException as exc:  # the client went away, or a sequence failed: free the others
            await asyncio.gather(*(self.core.abort(r.request_id) for i, r in enumerate(reqs) if i not in finished),
                                 return_exceptions=True)
            if not isinstance(exc, Exception):
                raise
            outputs.put_nowait(exc)  # re-raised in the request's own task

    async def speculation(self) -> dict:
        """The verification budget's state in this replica (``CoordinatorCore.speculation``)."""
        await asyncio.shield(_detached(self.core.start()))
        return await self.core.speculation()

    async def drafters(self, action: str, args: dict) -> dict:
        """Online learning's operations (``CoordinatorCore.drafters``)."""
        await asyncio.shield(_detached(self.core.start()))
        return await self.core.drafters(action, **args)

    def _load(self) -> tuple[int, int]:
        """(waiting, running) sequences of this replica. Counted here: with a colocated
        worker the queue lives in that actor, not in ``self.core.scheduler``."""
        return max(0, self._inflight - self.max_num_seqs), min(self._inflight, self.max_num_seqs)

    async def __del__(self):
        try:
            await self.core.shutdown()
        except Exception:  # the cluster may already be gone
            pass
