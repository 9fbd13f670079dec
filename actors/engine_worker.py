"""The engine worker: the target model and the step driver (``LLMEngine``) in one actor.

A plain class; ``ray.remote`` is applied with the placement options of its role (so it is
testable without Ray). In the colocated layout every proposer runs inside it; in the
separate layout methods placed ``"worker"`` (the draft model on its own GPU, the n-gram
pool) run in ProposerWorkers (``actors/proposer_worker.py``) that it drives through
``RemoteProposer`` proxies, while methods that read the target's features (Medusa heads)
stay beside the target, so features never cross actors.

With ``tensor_parallel_size`` N > 1 this worker is rank 0 of the target's group: it starts
ranks 1..N-1 (``actors/tp_worker.py``) in the bundles it is given and its engine's runners
are split and mirrored to them; a step that fails because a rank was lost ends this worker's
service (``poll`` reports ``lost``) and the coordinator rebuilds the replica.
"""

from __future__ import annotations

import asyncio
import logging

from specray.actors.learner import OnlineSync
from specray.actors.proposer_proxy import RemoteProposer
from specray.actors.proposer_worker import Placed, on_this_device, set_worker_threads
from specray.actors.suffix_cache import suffix_cache_for
from specray.actors.tp_worker import TensorParallelGroup
from specray.engine.config import EngineConfig
from specray.engine.drafter_versions import read_version
from specray.engine.llm_engine import LLMEngine
from specray.engine.gc_pauses import freeze_loaded_heap
from specray.policies.registry import ProposerContext

log = logging.getLogger(__name__)


def overlaps_by_default(device: str) -> bool:
    """Overlapped drafting pays where the draft has a device of its own that would idle while
    the target verifies (a GPU). On the CPU the workers share the host's cores: the ahead
    forward, wasted whenever its guess fails, takes cycles from the verification it overlaps
    (``python -m specray.bench.actors`` runs both)."""
    return device.startswith("cuda")


class EngineWorker(Placed):
    """The target and the step driver in one actor, stepping on its own.

    Requests come in with ``add``; the worker runs steps for as long as it has work (no call
    per step), and the coordinator long-polls ``poll`` for what they produced: the engine's
    step deltas (``engine/delta.py``), so what crosses actors stays proportional to what a
    step adds. With each poll come the metrics and generator states of the requests still
    running, so the coordinator can continue them elsewhere exactly.

    remote: method -> actor options for the methods that run in ProposerWorkers of their
    own (separate layout); empty = every proposer in this actor (colocated layout).
    overlap: remote proposers draft the next step while the target verifies this one (None:
    ``overlaps_by_default``).
    suffix_cache: ``SuffixCacheConfig`` of suffix decoding's global tree (default: shared with
    the other engine workers through the tree actor).
    tp_ranks: actor options (placement bundles) of tensor-parallel ranks 1..N-1.
    """

    def __init__(self, config: EngineConfig, remote: dict[str, dict] | None = None, overlap: bool | None = None,
                 suffix_cache: dict | None = None, online: dict | None = None, tp_ranks: list[dict] | None = None):
        set_worker_threads()
        config = on_this_device(config)
        if overlap is None:
            overlap = overlaps_by_default(config.device)
        self.remote: dict[str, RemoteProposer] = {}
        self.group = TensorParallelGroup(config, tp_ranks or []) if config.tensor_parallel_size > 1 else None
        self._lost: str | None = None  # set when a tensor-parallel rank was lost: this worker serves no more

        def proxy(method: str, options: dict):
            def make(ctx: ProposerContext) -> RemoteProposer:  # drafts over the target's vocab and context
                self.remote[method] = RemoteProposer(method, config, options, ctx.vocab_size, ctx.capacity, overlap,
                                                    ctx.target.paging)
                return self.remote[method]

            return make

        self.engine = LLMEngine(config, proposers={m: proxy(m, o) for m, o in (remote or {}).items()},
                                resources={"suffix": suffix_cache_for(suffix_cache or {},
                                                                      f"{config.target}|{config.tokenizer}")},
                                runners=self.group.runners if self.group is not None else None)
        self._lock = asyncio.Lock()
        # Online learning (actors/learner.py): traces out, drafter versions in, off the step's path.
        self.online = OnlineSync(self.engine, online, f"{config.target}|{config.tokenizer}", self._lock) \
            if online and self.engine.versions is not None else None
        self._outbox: list = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        freeze_loaded_heap()  # full collections skip the loaded engine: no long pauses mid-step

    async def start(self, timeout_s: float) -> dict:
        """Wait (bounded) for the proposer workers, so that the first requests speculate;
        one still loading only costs speed. Returns the validation limits."""
        if self.remote:
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait_ready() for p in self.remote.values())), timeout_s)
            except Exception as exc:  # noqa: BLE001 - timeout or a worker that failed to start
                log.warning("proposer workers not ready at start (%s); decoding plainly until they are", exc)
        return self.engine.limits.to_dict()

    def limits(self) -> dict:
        return self.engine.limits.to_dict()

    async def add(self, requests: list) -> None:
        """Requests (records made by the coordinator's intake) join the engine together."""
        if self.online is not None:
            self.online.start()
        if self._lost is not None:  # the coordinator replays every request it tracks on the next worker
            return
        for request in requests:
            self.engine.add(request)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.engine.has_unfinished():
            try:
                async with self._lock:
                    deltas = await self.engine.step_deltas()
            except Exception as exc:  # noqa: BLE001 - fail what was in flight, keep serving
                if self.group is not None and (lost := await self.group.lost(exc)) is not None:
                    # The group cannot step again: the coordinator replays this worker's requests
                    # on a new one (a new group), as when the worker itself dies.
                    log.error("%s; this engine worker stops serving", lost)
                    self._lost = lost
                    self._wake.set()
                    return
                # A step that fails outside the driver's per-row containment: every request in
                # it ends with 'error' and the message (HTTP 500), the worker serves on.
                log.exception("step failed")
                message = f"internal error: {type(exc).__name__}: {exc}"
                failed = (self.engine.fail(rid, message) for rid in self.engine.request_ids())
                deltas = [d for d in failed if d is not None]
            if deltas:
                self._outbox.extend(deltas)
                self._wake.set()
            await asyncio.sleep(0)  # let adds, aborts and polls in between steps
        for proxy in self.remote.values():  # idle: the finished requests' releases go now
            proxy.flush()

    async def poll(self) -> dict:
        """What the steps produced since the last poll (waits until there is something):
        ``outputs`` (``StepDelta`` dicts, in step order; a failed request's last one has
        finish reason 'error'), ``progress`` (per request still running: its metrics and the
        generator state of a seeded sampled one, see ``LLMEngine.progress``), ``kv`` (the target's
        KV pool: blocks, usage, prefix-cache queries and hits), ``lost`` (a tensor-parallel rank
        was lost: this worker serves no more)."""
        while not self._outbox and self._lost is None:
            self._wake.clear()
            await self._wake.wait()
        deltas, self._outbox = self._outbox, []
        progress = self.engine.progress({d.request_id for d in deltas if not d.finished})
        out = {"outputs": [d.to_dict() for d in deltas], "progress": progress, "kv": self.engine.executor.kv_stats(),
               "budget": getattr(self.engine.driver.length_policy, "totals", None)}
        if self._lost is not None:  # the coordinator replaces this worker and replays its requests
            out["lost"] = self._lost
        return out

    async def tensor_parallel(self) -> dict | None:
        """The group's further ranks (``actors``: their handles) and the control plane's cost so
        far (``rank0``, ``ranks``); None without TP."""
        if self.group is None:
            return None
        return {"actors": list(self.group.ranks), **await self.group.stats()}

    async def abort(self, request_id: str) -> bool:
        async with self._lock:  # never between a step's verify and its commit
            return self.engine.abort(request_id) is not None

    def describe(self) -> dict:
        """Which driver, executor and proposer classes this worker runs (tests, operations)."""
        return self.engine.describe()

    def proposer_handles(self) -> dict:
        return {m: p.handle for m, p in self.remote.items()}

    def phase_seconds(self, reset: bool = True) -> dict:
        """Seconds the driver waited for drafts and verified, and its steps (since the last reset)."""
        return self.engine.stats(reset)["phases"]

    def overlap_stats(self) -> dict:
        """Per remote method: rows served by a draft made during the previous verification (and
        whether this worker overlaps at all)."""
        return {m: {"hits": p.hits, "rows": p.rows, "overlap": p.overlap} for m, p in self.remote.items()}

    def restarts(self) -> dict:
        return {m: p.restarts for m, p in self.remote.items()}

    # -- drafter versions (online learning) ------------------------------------------------------
    async def load_drafter(self, method: str, directory: str) -> str:
        """Serve ``method``'s weights from ``directory`` here from the next step on, and through
        the learner hub in every replica; returns the version's name."""
        if self.engine.versions is None:
            raise ValueError("loading drafter versions needs online_learning.enabled (--online-learning)")
        v = read_version(method, directory, self.engine.proposers.context)
        if self.online is not None:
            v.version = await self.online.publish(v)
        async with self._lock:
            self.engine.use_drafter(v)
        return v.version

    def speculation(self) -> dict:
        """The speculation-length policy's state (``LLMEngine.speculation``)."""
        return self.engine.speculation()

    def drafter_status(self) -> dict:
        if self.engine.versions is None:
            return {"enabled": False}
        return {"enabled": True, **self.engine.versions.status(),
                "sync": self.online.state if self.online is not None else "in-process",
                "captured": self.engine.capture.captured}
