"""How the coordinator executes a step: over separate actors, or in one colocated actor.

Both expose ``add``, ``abort``, ``await step() -> outputs`` and ``fail_all``. The
separate backend runs the engine core's step functions with remote calls: proposals
are ObjectRefs gathered concurrently, the target verifies in one call, commits are
fire-and-forget (Ray keeps one caller's calls to an actor in order).

Faults: a proposer that dies costs only speed — its rows decode plainly (same greedy
output) while a fresh actor loads, and speculation resumes when it is ready. A target
that dies fails the in-flight requests with ``WorkerLostError``; a fresh target is
created and new requests succeed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Callable

import ray
from ray.exceptions import RayActorError

from specray.actors.workers import EngineWorker, ProposerWorker, TargetWorker
from specray.engine import step as S
from specray.engine.config import EngineConfig
from specray.engine.request import Request, RequestOutput
from specray.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

PROPOSER_START_TIMEOUT_S = 120.0


class WorkerLostError(RuntimeError):
    """A model worker died while it served this request."""


class _Supervised:
    """An actor handle that is recreated when it dies; ``ready`` says whether it can serve."""

    def __init__(self, name: str, make: Callable[[], object]):
        self.name, self._make = name, make
        self.restarts = 0
        self._spawn()

    def _spawn(self) -> None:
        self.handle = self._make()
        self._ready_ref = self.handle.__ray_ready__.remote()
        self._ready = False

    def ready(self) -> bool:
        if not self._ready:
            done, _ = ray.wait([self._ready_ref], timeout=0)
            # Done also when construction failed: the next call raises and replaces it.
            self._ready = bool(done)
        return self._ready

    async def wait_ready(self) -> None:
        await self._ready_ref
        self._ready = True

    def replace(self) -> None:
        log.warning("%s worker lost; starting a new one", self.name)
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # already gone
            pass
        self.restarts += 1
        self._spawn()


class SeparateBackend:
    def __init__(self, config: EngineConfig, placement, scheduler: Scheduler, ngram_cpus: float):
        self.scheduler = scheduler
        self.length_policy = config.speculation_length
        self.tokenizer = scheduler.tokenizer
        self._config, self._placement, self._ngram_cpus = config, placement, ngram_cpus
        target_cls = ray.remote(TargetWorker)
        self.target = _Supervised("target", lambda: target_cls.options(**placement.options("target")).remote(config))
        self.proposers: dict[str, _Supervised] = {}

    def _start_proposers(self, vocab_size: int) -> None:
        """Proposers draft over the target's vocabulary (its LM head, padding included)."""
        config, placement = self._config, self._placement
        proposer_cls = ray.remote(ProposerWorker)
        self.proposers["ngram"] = _Supervised(
            "ngram", lambda: proposer_cls.options(num_cpus=self._ngram_cpus).remote("ngram", None, vocab_size)
        )
        if config.medusa:
            self.proposers["medusa"] = self.target  # heads live with the target's hidden states
        if config.draft:
            self.proposers["draft"] = _Supervised(
                "draft", lambda: proposer_cls.options(**placement.options("draft")).remote("draft", config, vocab_size)
            )

    async def start(self, proposer_timeout_s: float = PROPOSER_START_TIMEOUT_S) -> dict:
        """Wait for the target, then (bounded) for the proposers, so that the first requests
        already speculate; a proposer that is still loading only costs speed."""
        await self.target.wait_ready()
        limits = await self.target.handle.limits.remote()
        self.vocab_size = limits["vocab_size"]
        self._start_proposers(self.vocab_size)
        others = [w for w in self.proposers.values() if w is not self.target]
        try:
            await asyncio.wait_for(asyncio.gather(*(w.wait_ready() for w in others)), proposer_timeout_s)
        except (asyncio.TimeoutError, RayActorError) as exc:
            log.warning("proposer workers not ready at start (%s); decoding plainly until they are", exc)
        return limits

    @property
    def capacity(self) -> int:
        return self.scheduler.limits.capacity

    def add(self, request: Request) -> None:
        self.scheduler.add(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    async def abort(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort(request_id, lambda req: self._release([req]))

    async def step(self) -> list[RequestOutput]:
        joining = self.scheduler.admit()
        outputs = []
        if joining:
            want = any(r.needs_hidden for r in joining)
            scores, hidden = await self._target_call(
                "prefill", [r.slot for r in joining], [r.prompt_ids for r in joining], want, S.sampled_rows(joining)
            )
            tokens = S.first_tokens(joining, scores)
            outputs += self._apply(S.commit_prefill(joining, tokens, self.capacity, self.tokenizer, hidden))
        fresh = {r.request_id for r in joining}
        batch = [r for r in self.scheduler.running.values() if r.request_id not in fresh]
        if batch:
            outputs += await self._speculate(batch)
        return outputs

    async def _speculate(self, batch: list[Request]) -> list[RequestOutput]:
        plan = S.plan_proposals(batch, self.capacity, self.length_policy)
        refs = {}
        for method, (_, rows) in plan.rows.items():
            worker = self.proposers.get(method)
            if worker is not None and worker.ready():  # else: plain decoding this step
                refs[method] = worker.handle.propose.remote([_remote_row(r) for r in rows])
        parts = {}
        for method, ref in refs.items():
            try:
                parts[method] = await ref
            except RayActorError:
                self.proposers[method].replace()
        draft, has_probs = S.merge_drafts(batch, plan, parts, self.vocab_size)
        scores, hidden = await self._target_call(
            "forward",
            [r.slot for r in batch],
            S.verify_tokens(batch, draft),
            S.logits_window(len(batch), draft),
            S.tree_inputs(draft),
            any(r.needs_hidden for r in batch),
            S.sampled_rows(batch),
        )
        result = S.accept(batch, draft, has_probs, scores)
        return self._apply(S.commit_step(batch, draft, result, self.capacity, self.tokenizer, hidden))

    async def _target_call(self, method: str, *args):
        try:
            return await getattr(self.target.handle, method).remote(*args)
        except RayActorError as exc:
            self.target.replace()
            raise WorkerLostError(f"the target worker died during {method}: {exc.__class__.__name__}") from exc

    def _apply(self, commit: S.Commit) -> list[RequestOutput]:
        if commit.target_lengths:
            self.target.handle.set_lengths.remote(commit.target_lengths)
        if commit.target_paths:  # after the lengths: Ray keeps one caller's calls in order
            self.target.handle.compact.remote(commit.target_paths)
        for method, (slots, counts) in commit.proposer_commits.items():
            if method in self.proposers:
                self.proposers[method].handle.commit.remote(slots, counts)
        self._release(commit.finished)
        return commit.outputs

    def _release(self, reqs: list[Request]) -> None:
        slots = [r.slot for r in reqs if self.scheduler.release(r)]
        if slots:
            self.target.handle.reset.remote(slots)
            for worker in self.proposers.values():
                if worker is not self.target:
                    worker.handle.release.remote(slots)

    def fail_all(self) -> list[str]:
        """Drop every request (after a target loss); returns their ids for error reporting."""
        running = list(self.scheduler.running.values())
        failed = running + list(self.scheduler.waiting)
        for r in running:
            r.finish_reason = "error"
        self.scheduler.waiting.clear()
        self._release(running)
        return [r.request_id for r in failed]

    def info(self) -> dict:
        return {"target": self.target.handle, **{m: w.handle for m, w in self.proposers.items() if w is not self.target}}


def _remote_row(row):
    """The request's generator stays with the coordinator (see ProposerWorker)."""
    seed = row.generator.initial_seed() if row.generator is not None else None
    return replace(row, generator=None, options={**row.options, "seed": seed})


class ColocatedBackend:
    """One EngineWorker actor holds target, draft and scheduler; one call per step."""

    def __init__(self, config: EngineConfig, placement, scheduler: Scheduler):
        self.scheduler = scheduler  # validation only; the worker keeps the queue
        cls = ray.remote(EngineWorker)
        self.worker = _Supervised("engine", lambda: cls.options(**placement.options("engine")).remote(config))
        self._pending: set[str] = set()

    async def start(self) -> dict:
        await self.worker.wait_ready()
        return await self.worker.handle.limits.remote()

    def add(self, request: Request) -> None:
        self._pending.add(request.request_id)
        self.worker.handle.add.remote(request)

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    async def abort(self, request_id: str):
        self._pending.discard(request_id)
        return await self.worker.handle.abort.remote(request_id)

    async def step(self) -> list[RequestOutput]:
        try:
            outputs = await self.worker.handle.step.remote()
        except RayActorError as exc:
            self.worker.replace()
            raise WorkerLostError(f"the engine worker died: {exc.__class__.__name__}") from exc
        for out in outputs:
            if out.finished:
                self._pending.discard(out.request_id)
        if not outputs:
            await asyncio.sleep(0.001)
        return outputs

    def fail_all(self) -> list[str]:
        failed = list(self._pending)
        self._pending.clear()
        return failed

    def info(self) -> dict:
        return {"engine": self.worker.handle}
