"""The Coordinator actor: validation, request queues and streams over one engine worker.

    coordinator = Coordinator.remote(SpecrayConfig(target=DIR, draft=DIR))
    outs = ray.get(coordinator.generate.remote(["def f(x):"], {"max_tokens": 32, "temperature": 0},
                                               {"method": "draft", "num_speculative_tokens": 4}))
    async for out in coordinator.stream.remote("import os", {"max_tokens": 16}):
        print(out["new_token_ids"])

``stream`` yields the engine's step deltas (``StepDelta`` dicts, ``engine/delta.py``: the new
tokens and text, the step's speculation event, metrics once finished) as they come, so a chunk
costs what its step added; ``generate`` returns whole ``RequestOutput`` dicts, assembled once.
Bad parameters raise ``ValueError`` before anything is queued. The engine worker steps on its
own and the coordinator long-polls what it produced. The coordinator keeps every request's
committed tokens:
when the engine worker dies, a new one starts and each request in flight is re-prefilled
there (prompt + tokens already emitted) and continues — greedy output unchanged, streams
unbroken, seeded sampled requests from the generator state of their last delivered token.
Only a request that cannot be replayed raises ``WorkerLostError``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from dataclasses import dataclass, field

import ray
import torch
from pydantic import ValidationError
from ray.exceptions import RayActorError

from specray.actors.config import SpecrayConfig
from specray.actors.learner import hub_for
from specray.actors.proposer_proxy import Supervised
from specray.actors.engine_worker import EngineWorker
from specray.cluster.placement import reserve
from specray.engine.config import load_tokenizer
from specray.engine.delta import OutputAssembly, StepDelta
from specray.engine.intake import RequestMaker
from specray.engine.metrics import SpecMetrics
from specray.engine.tensor_parallel import check_splits
from specray.engine.params import SamplingParams
from specray.engine.request import Request
from specray.policies.registry import Limits, method_spec, parse_speculation, registered_methods

log = logging.getLogger(__name__)

_FAILED = object()  # queue marker: the request could not be served
PROPOSER_START_TIMEOUT_S = 120.0
REPLAY_ATTEMPTS = 3  # engine workers started for one request before it fails


class WorkerLostError(RuntimeError):
    """A model worker died and this request could not be continued on a new one."""


class StartError(RuntimeError):
    """The workers could not start (their models did not load, the placement cannot be had):
    the cause, as one line. It stands: the coordinator does not try again."""


@dataclass
class _Tracked:
    """What the coordinator knows of a request in flight: enough to replay it elsewhere."""

    request: Request
    output_ids: list[int] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    generator_state: torch.Tensor | None = None
    replays: int = 0


class CoordinatorCore:
    """The coordinator's logic as a plain class (an async Ray actor wraps it).

    It validates requests, owns their queues, and drives one engine worker — the actor that
    holds the target and runs the step driver. In the separate layout that worker drives the
    draft / n-gram workers itself (in their own bundles); in the colocated layout it holds
    every model.
    """

    def __init__(self, config: SpecrayConfig | dict | None = None):
        self.config = SpecrayConfig.model_validate(config or {}).resolved()
        self._start_lock = asyncio.Lock()
        self.placement = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._errors: dict[str, str] = {}
        self._tracked: dict[str, _Tracked] = {}
        self.totals = SpecMetrics()
        self.kv: dict = {}  # the engine worker's KV pool (paged): blocks, usage, prefix-cache counts
        self.budget: dict = {}  # the verification budget's totals: steps decided, rows, slots admitted
        self._loop_task: asyncio.Task | None = None
        self._started = False
        self._start_error: str | None = None

    async def start(self) -> None:
        """Reserve the placement and start the workers (once; later calls return at once).
        If they cannot start, StartError with the cause — now and on every later call: what
        was reserved is given back and nothing is retried (a retry would wait on the same
        cause, or on the placement group the first try left behind)."""
        async with self._start_lock:
            if self._start_error is not None:
                raise StartError(self._start_error)
            if not self._started:
                try:
                    await self._start_workers()
                except Exception as exc:  # noqa: BLE001 - any cause: said once, and it stands
                    self._start_error = f"the engine's workers failed to start: {_cause(exc)}"
                    log.error("%s", self._start_error)
                    self._release()
                    raise StartError(self._start_error) from None

    async def _start_workers(self) -> None:
        cfg = self.config
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.target)
        engine_cfg = cfg.engine_config()
        check_splits(engine_cfg)  # a checkpoint that cannot be split is refused before anything is reserved
        self.placement = await reserve(cfg.placement, drafts=self._draft_models(),
                                       tensor_parallel_size=cfg.tensor_parallel_size)
        colocated = cfg.placement.mode == "colocated"
        self.role = "engine" if colocated else "target"
        remote = {} if colocated else self._remote_methods()
        options, ranks = self.placement.options(self.role), self.placement.rank_options(self.role)
        cls = ray.remote(EngineWorker)
        overlap, suffix = cfg.overlap_drafting, cfg.suffix_cache.model_dump()
        online = cfg.online_learning.model_dump() if cfg.online_learning.enabled else None
        self.worker = Supervised(self.role, lambda: cls.options(**options).remote(engine_cfg, remote, overlap, suffix,
                                                                                  online, ranks))
        limits = Limits.from_dict(await self._worker_started())
        # As OpenAI and vLLM: prompt + max_tokens beyond the context is refused (ContextLengthError).
        self.intake = RequestMaker(limits, self.tokenizer, cfg.default_speculation, strict_context=True)
        self._started = True

    async def _worker_started(self) -> dict:
        await self.worker.wait_ready()
        return await self.worker.handle.start.remote(PROPOSER_START_TIMEOUT_S)

    def _draft_models(self) -> list[str]:
        """The draft models loaded (``draft``, ``pard``) that get a bundle of their own (their GPU):
        all of them but a draft split with the target (draft_tensor_parallel_size N lives in the
        target's ranks)."""
        cfg = self.config
        engine = cfg.engine_config()
        return [m for m in registered_methods() if method_spec(m).placement == "worker"
                and method_spec(m).checkpoint is not None and engine.checkpoint(method_spec(m).checkpoint)
                and not (method_spec(m).checkpoint == "draft" and cfg.draft_tp > 1)]

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
            if spec.checkpoint == "draft" and cfg.draft_tp > 1:  # split over the target's ranks, driven by rank 0
                continue
            in_bundle = name in self.placement.roles
            remote[name] = self.placement.options(name) if in_bundle else {"num_cpus": cfg.placement.ngram_cpus}
        return remote

    # -- API -----------------------------------------------------------------------------
    async def submit(self, prompt, sampling=None, speculation=None, request_id=None) -> str:
        return (await self._submit(prompt, sampling, speculation, request_id)).request_id

    async def _submit(self, prompt, sampling=None, speculation=None, request_id=None) -> Request:
        return (await self.submit_all([(prompt, sampling, speculation, request_id)]))[0]

    async def submit_all(self, items) -> list[Request]:
        """Submit requests together, each ``(prompt, sampling, speculation, request_id)``:
        every one is validated before any is queued, so a bad one (ValueError) leaves
        nothing running, and they join the engine in one call."""
        await self.start()
        reqs = [self.intake.make(
            prompt,
            _validated(SamplingParams.model_validate, sampling or {}),
            _validated(parse_speculation, speculation) if speculation is not None else None,
            request_id,
        ) for prompt, sampling, speculation, request_id in items]
        seen: set[str] = set()
        for req in reqs:
            if req.request_id in self._queues or req.request_id in seen:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            seen.add(req.request_id)
        for req in reqs:
            self._queues[req.request_id] = asyncio.Queue()
            self._tracked[req.request_id] = _Tracked(req)
        await self.worker.handle.add.remote(reqs)
        if self._loop_task is None or self._loop_task.done():
            # A fresh context: Ray would otherwise treat the request that happened to start
            # the loop as the parent of every worker call, and cancelling that request
            # (its client went away) would cancel the shared loop's calls.
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(), context=contextvars.Context())
        return reqs

    async def outputs(self, request_id: str):
        """Async iterator over a submitted request's step deltas (dicts), until it finishes."""
        queue = self._queues[request_id]
        try:
            while True:
                item = await queue.get()
                if item is _FAILED:
                    raise WorkerLostError(self._errors.pop(request_id, "worker lost"))
                yield item
                if item["finished"]:
                    return
        finally:
            self._queues.pop(request_id, None)

    async def generate(self, prompts, sampling=None, speculation=None) -> list[dict]:
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        specs = speculation if isinstance(speculation, (list, tuple)) else [speculation] * len(prompts)
        reqs = await self.submit_all([(p, s, sp, None) for p, s, sp in zip(prompts, samplings, specs)])

        async def final(req: Request) -> dict:
            whole = OutputAssembly(req.request_id, req.prompt_ids)
            async for delta in self.outputs(req.request_id):
                whole.add(delta)
            return whole.whole

        return list(await asyncio.gather(*(final(req) for req in reqs)))

    async def stream(self, prompt, sampling=None, speculation=None, request_id=None):
        rid = await self.submit(prompt, sampling, speculation, request_id)
        finished = False
        try:
            async for delta in self.outputs(rid):
                finished = delta["finished"]
                yield delta
        finally:
            if not finished:  # the consumer went away: free the sequence
                await self.abort(rid)

    async def abort(self, request_id: str) -> bool:
        tracked = self._tracked.pop(request_id, None) if self._started else None
        if tracked is None:
            return False
        try:
            await self.worker.handle.abort.remote(request_id)
        except RayActorError:  # the worker is gone: nothing to free there
            pass
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(StepDelta(request_id, [], finished=True, finish_reason="abort",
                                       metrics=tracked.metrics or SpecMetrics().to_dict()).to_dict())
        return True

    async def shutdown(self) -> None:
        """Fail what is in flight, kill the workers and give the placement group back."""
        if self._started:
            for rid in list(self._tracked):
                self._fail(rid, "the coordinator is shutting down")
        if self._loop_task is not None:
            self._loop_task.cancel()
        handles = {}
        if hasattr(self, "worker"):
            try:
                handles = await self.worker.handle.proposer_handles.remote()
            except Exception:  # noqa: BLE001 - the worker is gone already
                pass
        self._release(handles.values())
        self._started = False

    def _release(self, others=()) -> None:
        """Kill the workers and give the placement group back."""
        for handle in [*([self.worker.handle] if hasattr(self, "worker") else []), *others]:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    async def stats(self) -> dict:
        if not self._started:
            return {"started": False}
        try:
            restarts = await self.worker.handle.restarts.remote()
        except Exception:  # noqa: BLE001 - the worker is being replaced
            restarts = {}
        return {
            "started": True,
            "in_flight": len(self._tracked),
            "totals": self.totals.to_dict(),
            "restarts": {self.role: self.worker.restarts, **restarts},
        }

    async def workers(self) -> dict:
        """Handles of the workers by role (for tests and operations)."""
        await self.start()
        return {self.role: self.worker.handle, **await self.worker.handle.proposer_handles.remote()}

    async def speculation(self) -> dict:
        """The speculation-length policy's state in this replica's engine (``LLMEngine.speculation``)."""
        await self.start()
        return await self.worker.handle.speculation.remote()

    # -- drafter versions (online learning, actors/learner.py) ----------------------------------
    async def drafters(self, action: str = "status", **args) -> dict:
        """Online learning's operations: ``status``; ``load`` (method, path: a directory in the
        method's public layout, served by every replica next); ``learning`` (enabled: the runtime
        switch); ``pin`` (method, version; None unpins); ``rollback`` (method: the serving version
        is retired, the one before serves); ``export`` (method, version, path). ValueError on
        anything else, or when online learning is off."""
        await self.start()
        cfg = self.config.online_learning
        if not cfg.enabled:
            raise ValueError("online learning is off: start the server with --online-learning "
                             "(online_learning.enabled; online_learning.learn: false only loads versions)")
        needs = {"load": ("method", "path"), "learning": ("enabled",), "pin": ("method",), "rollback": ("method",),
                 "export": ("method", "version", "path")}.get(action, ())
        missing = [k for k in needs if k not in args]
        if missing:
            raise ValueError(f"drafters {action}: missing {', '.join(missing)}")
        if action == "load":
            return {"version": await self.worker.handle.load_drafter.remote(args["method"], args["path"])}
        hub, _ = hub_for(cfg, f"{self.config.target}|{self.config.tokenizer}")
        if action == "status":
            return {**await hub.status.remote(), "replica": await self.worker.handle.drafter_status.remote()}
        if action == "learning":
            await hub.set_learning.remote(bool(args["enabled"]))
            return {"learning": bool(args["enabled"])}
        if action == "pin":
            await hub.pin.remote(args["method"], args.get("version"))
            return {"pinned": args.get("version")}
        if action == "rollback":
            return {"serving": await hub.rollback.remote(args["method"])}
        if action == "export":
            return {"path": await hub.export.remote(args["method"], args["version"], args["path"])}
        raise ValueError(f"unknown drafters action {action!r}: status, load, learning, pin, rollback or export")

    # -- the loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        while self._tracked:
            try:
                batch = await self.worker.handle.poll.remote()
            except RayActorError as exc:
                await self._recover(f"the {self.role} worker died: {exc.__class__.__name__}")
                continue
            except Exception as exc:  # never let one bad poll kill the loop
                log.exception("poll failed")
                for rid in list(self._tracked):
                    self._fail(rid, f"internal error: {exc}")
                continue
            self.kv = batch.get("kv") or self.kv  # the engine worker's KV pool, as of its last step
            self.budget = batch.get("budget") or self.budget
            for delta in batch["outputs"]:
                self._deliver(delta)
            for rid, progress in batch["progress"].items():
                if rid in self._tracked:
                    self._tracked[rid].metrics = progress["metrics"]
                    self._tracked[rid].generator_state = progress["generator"]
            if batch.get("lost"):  # a tensor-parallel rank: the replica's group is rebuilt
                await self._recover(f"the {self.role} worker's {batch['lost']}")

    def _deliver(self, delta: dict) -> None:
        """Pass a step delta on, as it is, to its request's stream; keep its tokens (to replay)."""
        rid = delta["request_id"]
        tracked = self._tracked.get(rid)
        if tracked is None:  # aborted (or failed) meanwhile
            return
        tracked.output_ids += delta["new_token_ids"]
        if delta["finished"]:
            del self._tracked[rid]
            self.totals.merge(SpecMetrics.from_dict(delta["metrics"]))
        queue = self._queues.get(rid)
        if queue is not None:
            queue.put_nowait(delta)

    async def _recover(self, message: str) -> None:
        """A new engine worker, and every request in flight replayed on it."""
        log.error("%s; starting a new one and replaying %d requests", message, len(self._tracked))
        self.worker.replace()
        try:
            await self._worker_started()
        except Exception as exc:  # noqa: BLE001 - it will not come up: nothing can be replayed
            for rid in list(self._tracked):
                self._fail(rid, f"{message}; a new worker failed to start: {exc}")
            return
        for rid, t in list(self._tracked.items()):
            t.replays += 1
            if t.replays > REPLAY_ATTEMPTS:
                self._fail(rid, f"{message}; gave up after {REPLAY_ATTEMPTS} replays")
                continue
            generator = t.request.generator
            if t.generator_state is not None:
                generator = torch.Generator()
                generator.set_state(t.generator_state)
            metrics = SpecMetrics.from_dict(t.metrics) if t.metrics else SpecMetrics()
            resumed = t.request.resumed(t.output_ids, self.tokenizer, metrics, generator)
            try:
                await self.worker.handle.add.remote([resumed])
            except RayActorError:
                return  # lost again: the next poll recovers once more

    def _fail(self, request_id: str, message: str) -> None:
        self._tracked.pop(request_id, None)
        queue = self._queues.get(request_id)
        if queue is not None:
            self._errors[request_id] = message
            queue.put_nowait(_FAILED)


def _cause(exc: BaseException) -> str:
    """The root cause of a start failure as one line (a worker's constructor error arrives
    wrapped by Ray, its traceback in the message: its last line is the error)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return _cause(cause)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return text if ":" in text and not text.startswith("(") else f"{type(exc).__name__}: {text}"


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
        await self.start()
        return await self.stats()
