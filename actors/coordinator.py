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
from ray.exceptions import RayActorError

from specray.actors.config import SpecrayConfig
from specray.actors.placement import reserve
from specray.actors.remote import Supervised
from specray.actors.workers import EngineWorker
from specray.engine.config import load_tokenizer
from specray.engine.metrics import SpecMetrics
from specray.engine.params import SamplingParams
from specray.engine.scheduler import Scheduler
from specray.policies.registry import Limits, method_spec, parse_speculation, registered_methods

log = logging.getLogger(__name__)

_FAILED = object()  # queue marker: the request died with its worker
PROPOSER_START_TIMEOUT_S = 120.0


class WorkerLostError(RuntimeError):
    """A model worker died while it served this request."""


class CoordinatorCore:
    """The coordinator's logic as a plain class (an async Ray actor wraps it).

    It validates requests, owns their queues, and drives one engine worker — the actor that
    holds the target and runs the step driver — one step per call. In the separate layout
    that worker drives the draft / n-gram workers itself (in their own bundles); in the
    colocated layout it holds every model.
    """

    def __init__(self, config: SpecrayConfig | dict | None = None):
        self.config = SpecrayConfig.model_validate(config or {}).resolved()
        self._start_lock = asyncio.Lock()
        self.placement = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._errors: dict[str, str] = {}
        self._pending: set[str] = set()
        self.totals = SpecMetrics()
        self._loop_task: asyncio.Task | None = None
        self._started = False

    async def _start(self) -> None:
        async with self._start_lock:
            if not self._started:
                await self._start_workers()

    async def _start_workers(self) -> None:
        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.target)
        self.placement = await reserve(cfg.placement, with_draft=cfg.draft is not None)
        colocated = cfg.placement.mode == "colocated"
        self.role = "engine" if colocated else "target"
        remote = {} if colocated else self._remote_methods()
        engine_cfg, options = cfg.engine_config(), self.placement.options(self.role)
        cls = ray.remote(EngineWorker)
        self.worker = Supervised(self.role, lambda: cls.options(**options).remote(engine_cfg, remote))
        await self.worker.wait_ready()
        limits = Limits.from_dict(await self.worker.handle.start.remote(PROPOSER_START_TIMEOUT_S))
        self.scheduler = Scheduler(cfg.max_num_seqs, limits, self.tokenizer, cfg.default_speculation)
        self._started = True

    def _remote_methods(self) -> dict[str, dict]:
        """Separate layout: each method placed "worker" in an actor of its own — the draft
        model in its bundle (its own GPU), the n-gram pool on a CPU share."""
        cfg, remote = self.config, {}
        for name in registered_methods():
            spec = method_spec(name)
            if spec.placement != "worker" or spec.build is None:
                continue
            if spec.checkpoint is not None and not cfg.engine_config().checkpoint(spec.checkpoint):
                continue
            in_bundle = name in self.placement.roles
            remote[name] = self.placement.options(name) if in_bundle else {"num_cpus": cfg.placement.ngram_cpus}
        return remote

    # -- API -----------------------------------------------------------------------------
    async def submit(self, prompt, sampling=None, speculation=None, request_id=None) -> str:
        await self._start()
        req = self.scheduler.make_request(
            prompt,
            _validated(SamplingParams.model_validate, sampling or {}),
            _validated(parse_speculation, speculation) if speculation is not None else None,
            request_id,
        )
        if req.request_id in self._queues:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self._queues[req.request_id] = asyncio.Queue()
        self._pending.add(req.request_id)
        self.worker.handle.add.remote(req)
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
        if not self._started or request_id not in self._pending:
            return False
        self._pending.discard(request_id)
        out = await self.worker.handle.abort.remote(request_id)
        queue = self._queues.get(request_id)
        if out is not None and queue is not None:
            queue.put_nowait(out)
        return out is not None

    async def shutdown(self) -> None:
        """Fail what is in flight, kill the workers and give the placement group back."""
        if self._started:
            for rid in self._fail_all():
                self._fail(rid, "the coordinator is shutting down")
        if hasattr(self, "worker"):
            try:
                handles = await self.worker.handle.proposer_handles.remote()
            except Exception:  # noqa: BLE001 - the worker is gone already
                handles = {}
            for handle in [self.worker.handle, *handles.values()]:
                ray.kill(handle, no_restart=True)
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
        self._started = False

    async def stats(self) -> dict:
        if not self._started:
            return {"started": False}
        try:
            restarts = await self.worker.handle.restarts.remote()
        except Exception:  # noqa: BLE001 - the worker is being replaced
            restarts = {}
        return {
            "started": True,
            "in_flight": len(self._pending),
            "totals": self.totals.to_dict(),
            "restarts": {self.role: self.worker.restarts, **restarts},
        }

    async def workers(self) -> dict:
        """Handles of the workers by role (for tests and operations)."""
        await self._start()
        return {self.role: self.worker.handle, **await self.worker.handle.proposer_handles.remote()}

    # -- the loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        while self._pending:
            try:
                outputs = await self.worker.handle.step.remote()
            except RayActorError as exc:
                self.worker.replace()
                message = f"the {self.role} worker died: {exc.__class__.__name__}"
                log.error("%s", message)
                for rid in self._fail_all():
                    self._fail(rid, message)
                continue
            except Exception as exc:  # never let one bad step kill the loop
                log.exception("step failed")
                for rid in self._fail_all():
                    self._fail(rid, f"internal error: {exc}")
                continue
            for out in outputs:
                if out.finished:
                    self._pending.discard(out.request_id)
                    self.totals.merge(SpecMetrics.from_dict(out.metrics))
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0 if outputs else 0.001)  # let new requests in between steps

    def _fail_all(self) -> list[str]:
        """Drop every request in flight (its worker is gone); returns their ids."""
        failed = list(self._pending)
        self._pending.clear()
        return failed

    def _fail(self, request_id: str, message: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            self._errors[request_id] = message
            queue.put_nowait(_FAILED)


def _validated(parse, value):
    """pydantic validation as a plain ValueError (Ray cannot re-raise ValidationError)."""
    try:
        return parse(value)
    except ValidationError as exc:
        raise ValueError(str(exc)) from None


@ray.remote(num_cpus=0)  # an async event loop that waits on workers; it reserves none
class Coordinator(CoordinatorCore):
    """``CoordinatorCore`` as an async Ray actor (the documented Python API)."""

    async def ready(self) -> dict:
        await self._start()
        return await self.stats()
