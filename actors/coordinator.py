"""The Coordinator actor: request queue + continuous-batching loop over the workers.

    coordinator = Coordinator.remote(SpecrayConfig(target=DIR, draft=DIR))
    outs = ray.get(coordinator.generate.remote(["def f(x):"], {"max_tokens": 32, "temperature": 0},
                                               {"method": "draft", "num_speculative_tokens": 4}))
    async for out in coordinator.stream.remote("import os", {"max_tokens": 16}):
        print(out["new_token_ids"])

Outputs are ``RequestOutput`` dicts. A request lost with its target worker raises
``WorkerLostError``; bad parameters raise ``ValueError`` before anything is queued.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging

import ray
from pydantic import ValidationError

from specray.actors.backends import ColocatedBackend, SeparateBackend, WorkerLostError
from specray.cluster.config import SpecrayConfig
from specray.cluster.placement import reserve
from specray.engine.config import load_tokenizer
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.scheduler import ModelLimits, Scheduler

log = logging.getLogger(__name__)

_FAILED = object()  # queue marker: the request died with its worker


class CoordinatorCore:
    """The coordinator's logic as a plain class (an async Ray actor wraps it)."""

    def __init__(self, config: SpecrayConfig | dict | None = None):
        self.config = SpecrayConfig.model_validate(config or {}).resolved()
        self._start_lock = asyncio.Lock()
        self.placement = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._errors: dict[str, str] = {}
        self._loop_task: asyncio.Task | None = None
        self._started = False

    async def _start(self) -> None:
        async with self._start_lock:
            if not self._started:
                await self._start_workers()

    async def _start_workers(self) -> None:
        cfg, placeholder = self.config, ModelLimits(2, 1, frozenset(), False)
        engine_cfg = cfg.engine_config()
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.target)
        self.placement = await reserve(cfg.placement, with_draft=cfg.draft is not None)
        self.scheduler = Scheduler(cfg.max_num_seqs, placeholder, self.tokenizer, cfg.default_speculation)
        if cfg.placement.mode == "colocated":
            self.backend = ColocatedBackend(engine_cfg, self.placement, self.scheduler)
        else:
            self.backend = SeparateBackend(engine_cfg, self.placement, self.scheduler, cfg.placement.ngram_cpus)
        limits = await self.backend.start()
        self.scheduler.limits = ModelLimits(
            capacity=limits["capacity"],
            vocab_size=limits["vocab_size"],
            eos_ids=frozenset(limits["eos_ids"]),
            has_draft=cfg.draft is not None,
            medusa_heads=limits.get("medusa_heads", 0),
        )
        self._started = True

    # -- API -----------------------------------------------------------------------------
    async def submit(self, prompt, sampling=None, speculation=None, request_id=None) -> str:
        await self._start()
        req = self.scheduler.make_request(
            prompt,
            _validated(SamplingParams, sampling or {}),
            _validated(SpeculationParams, speculation) if speculation is not None else None,
            request_id,
        )
        if req.request_id in self._queues:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._queues[req.request_id] = asyncio.Queue()
        self.backend.add(req)
        if self._loop_task is None or self._loop_task.done():
            # A fresh context: Ray would otherwise treat the request that happened to start
            # the loop as the parent of every worker call, and cancelling that request
            # (its client went away) would cancel the shared loop's calls.
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())
        return req.request_id

    async def outputs(self, request_id: str):
        """Async iterator over a submitted request's step outputs, until it finishes."""
        queue = self._queues[request_id]
        try:
            while True:
                item = await queue.get()
                if item is _FAILED:
                    raise WorkerLostError(self._errors.pop(request_id, "worker lost"))
                yield item
                if item.finished:
                    return
        finally:
            self._queues.pop(request_id, None)

    async def generate(self, prompts, sampling=None, speculation=None) -> list[dict]:
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        specs = speculation if isinstance(speculation, (list, tuple)) else [speculation] * len(prompts)
        ids = [await self.submit(p, s, sp) for p, s, sp in zip(prompts, samplings, specs)]

        async def final(rid):
            last = None
            async for out in self.outputs(rid):
                last = out
            return dataclasses.asdict(last)

        return list(await asyncio.gather(*(final(rid) for rid in ids)))

    async def stream(self, prompt, sampling=None, speculation=None, request_id=None):
        rid = await self.submit(prompt, sampling, speculation, request_id)
        finished = False
        try:
            async for out in self.outputs(rid):
                finished = out.finished
                yield dataclasses.asdict(out)
        finally:
            if not finished:  # the consumer went away: free the sequence
                await self.abort(rid)

    async def abort(self, request_id: str) -> bool:
        if not self._started:
            return False
        out = await self.backend.abort(request_id)
        queue = self._queues.get(request_id)
        if out is not None and queue is not None:
            queue.put_nowait(out)
        return out is not None

    async def shutdown(self) -> None:
        """Fail what is in flight, kill the workers and give the placement group back."""
        if self._started:
            for rid in self.backend.fail_all():
                self._fail(rid, "the coordinator is shutting down")
        if hasattr(self, "backend"):
            for worker in self._supervised().values():
                ray.kill(worker.handle, no_restart=True)
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        self._started = False

    def stats(self) -> dict:
        if not self._started:
            return {"started": False}
        return {
            "started": True,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "totals": self.scheduler.totals.to_dict(),
            "restarts": {name: w.restarts for name, w in self._supervised().items()},
        }

    def _supervised(self) -> dict:
        b = self.backend
        if isinstance(b, SeparateBackend):
            return {"target": b.target, **{m: w for m, w in b.proposers.items() if w is not b.target}}
        return {"engine": b.worker}

    async def workers(self) -> dict:
        """Handles of the workers by role (for tests and operations)."""
        await self._start()
        return self.backend.info()

    # -- the loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        while self.backend.has_unfinished():
            try:
                outputs = await self.backend.step()
            except WorkerLostError as exc:
                log.error("%s", exc)
                for rid in self.backend.fail_all():
                    self._fail(rid, str(exc))
                continue
            except Exception as exc:  # never let one bad step kill the loop
                log.exception("step failed")
                for rid in self.backend.fail_all():
                    self._fail(rid, f"internal error: {exc}")
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)  # let new requests in between steps

    def _fail(self, request_id: str, message: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            self._errors[request_id] = message
            queue.put_nowait(_FAILED)


def _validated(model, value):
    """pydantic validation as a plain ValueError (Ray cannot re-raise ValidationError)."""
    if isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ValueError(str(exc)) from None


@ray.remote(num_cpus=0)  # an async event loop that waits on workers; it reserves none
class Coordinator(CoordinatorCore):
    """``CoordinatorCore`` as an async Ray actor (the documented Python API)."""

    async def ready(self) -> dict:
        await self._start()
        return self.stats()
