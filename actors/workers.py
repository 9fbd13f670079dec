"""Model and proposer workers. Each is a plain class; ``ray.remote`` is applied with the
placement options of its role (so they are testable without Ray).

EngineWorker: the target model and the step driver (``LLMEngine``). In the colocated layout
every proposer runs inside it; in the separate layout methods placed ``"worker"`` (the
draft model on its own GPU, the n-gram pool) run in ProposerWorkers that it drives through
``RemoteProposer`` proxies, while methods that read the target's features (Medusa heads)
stay beside the target, so features never cross actors.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace
from typing import Sequence

import torch

from specray.actors.remote import RemoteProposer
from specray.actors.suffix_cache import suffix_cache_for
from specray.engine.config import EngineConfig
from specray.engine.engine import LLMEngine
from specray.engine.runner import ModelRunner
from specray.policies.base import CommitRow, Draft, PrefillRow, ProposalRow
from specray.policies.registry import ProposerContext, method_spec

log = logging.getLogger(__name__)


def worker_device() -> str:
    """The GPU Ray gave this actor, or the CPU (fake GPUs in tests, laptops)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _threads() -> None:
    # Small models on shared cores: one intra-op thread per worker avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("SPECRAY_WORKER_THREADS", "1")))


def _on_this_device(config: EngineConfig) -> EngineConfig:
    """Models load where this worker runs: only the worker sees the GPU Ray gave it (an
    explicit ``device`` is kept: ``--device cpu`` on a GPU machine)."""
    return replace(config, device=worker_device() if config.device == "auto" else config.device)


class _Placed:
    """Where Ray put this worker (tests and operations check placement with these)."""

    def gpu_ids(self) -> list:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


class ProposerWorker(_Placed):
    """Any method placed ``"worker"`` behind an actor (the draft model, the n-gram pool).

    Seeded sampling: the engine's generator must not be copied here (its copy would replay
    the acceptance test's uniforms), so each slot gets a draft generator of its own,
    seeded from the request's seed.
    """

    def __init__(self, method: str, config: EngineConfig, vocab_size: int, capacity: int):
        _threads()
        config = _on_this_device(config)
        spec = method_spec(method)

        def runner_for(model, extra_capacity: int = 0) -> ModelRunner:
            model = config.load_model(model) if isinstance(model, str) else model
            return ModelRunner(model, config.max_num_seqs, capacity + extra_capacity)

        ctx = ProposerContext(vocab_size=vocab_size, max_num_seqs=config.max_num_seqs, capacity=capacity,
                              device=config.device, dtype=config.resolved_dtype, runner_for=runner_for)
        path = config.checkpoint(spec.checkpoint) if spec.checkpoint else None
        resource = spec.load(path, ctx) if path else None
        self.proposer = spec.build(replace(ctx, resource=resource))
        self._generators: dict[int, torch.Generator] = {}
        self._tokens: dict[int, list[int]] = {}  # each slot's committed tokens (sent as tails)

    def _rows(self, rows: Sequence[tuple[int, ProposalRow]]) -> list[ProposalRow]:
        """Rows arrive as (offset, row with only the tokens from offset on): rebuild them."""
        full = []
        for offset, r in rows:
            tokens = self._tokens.get(r.slot, [])[:offset] + list(r.token_ids)
            self._tokens[r.slot] = tokens
            full.append(replace(r, token_ids=tokens, generator=self._generator(r)))
        return full

    def propose(self, rows: Sequence[tuple[int, ProposalRow]]) -> Draft:
        return self.proposer.propose(self._rows(rows))

    def propose_ahead(self, rows: Sequence[tuple[int, ProposalRow]], drafts: Draft) -> dict:
        """Overlapped drafting (see ``DraftModelProposer.propose_ahead``); {} if not supported."""
        if not hasattr(self.proposer, "propose_ahead"):
            return {}
        return self.proposer.propose_ahead(self._rows(rows), drafts)

    def _generator(self, row: ProposalRow) -> torch.Generator | None:
        if row.seed is None or row.sampling.greedy:
            return None
        if row.slot not in self._generators:
            # A different stream from the engine's (seed) for the same request.
            self._generators[row.slot] = torch.Generator().manual_seed((int(row.seed) * 1_000_003 + 12345) % 2**63)
        return self._generators[row.slot]

    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        if hasattr(self.proposer, "prefill"):
            self.proposer.prefill(rows)

    def commit(self, rows: Sequence[CommitRow]) -> None:
        self.proposer.commit(rows)

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.proposer.release(s)
            self._generators.pop(s, None)
            self._tokens.pop(s, None)


class EngineWorker(_Placed):
    """The target and the step driver in one actor, stepping on its own.

    Requests come in with ``add``; the worker runs steps for as long as it has work (no call
    per step), and the coordinator long-polls ``poll`` for what they produced: per request
    only the new tokens and the new text (the full text once, at the end), so what crosses
    actors stays proportional to what a step adds. With each poll come the generator states
    of seeded sampled requests, so the coordinator can continue them elsewhere exactly.

    remote: method -> actor options for the methods that run in ProposerWorkers of their
    own (separate layout); empty = every proposer in this actor (colocated layout).
    overlap: remote proposers draft the next step while the target verifies this one.
    suffix_cache: ``SuffixCacheConfig`` of suffix decoding's global tree (default: shared with
    the other engine workers through the tree actor).
    """

    def __init__(self, config: EngineConfig, remote: dict[str, dict] | None = None, overlap: bool = True,
                 suffix_cache: dict | None = None):
        _threads()
        config = _on_this_device(config)
        self.remote: dict[str, RemoteProposer] = {}

        def proxy(method: str, options: dict):
            def make(ctx: ProposerContext) -> RemoteProposer:  # drafts over the target's vocab and context
                self.remote[method] = RemoteProposer(method, config, options, ctx.vocab_size, ctx.capacity, overlap)
                return self.remote[method]

            return make

        self.engine = LLMEngine(config, proposers={m: proxy(m, o) for m, o in (remote or {}).items()},
                                resources={"suffix": suffix_cache_for(suffix_cache or {},
                                                                      f"{config.target}|{config.tokenizer}")})
        self._lock = asyncio.Lock()
        self._outbox: list = []
        self._errors: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._text_sent: dict[str, int] = {}
        self._loop_task: asyncio.Task | None = None

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

    async def add(self, request) -> None:
        self.engine.scheduler.add(request)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self.engine.has_unfinished():
            try:
                async with self._lock:
                    outputs = await self.engine.step_async()
            except Exception as exc:  # noqa: BLE001 - fail what was in flight, keep serving
                log.exception("step failed")
                for req in list(self.engine.scheduler.running.values()) + list(self.engine.scheduler.waiting):
                    self.engine.abort(req.request_id)
                    self._errors[req.request_id] = f"internal error: {type(exc).__name__}: {exc}"
                outputs = []
                self._wake.set()
            if outputs:
                self._outbox.extend(outputs)
                self._wake.set()
            await asyncio.sleep(0)  # let adds, aborts and polls in between steps

    async def poll(self) -> dict:
        """What the steps produced since the last poll (waits until there is something):
        ``outputs`` (deltas, see ``_delta``), ``states`` (generator states of seeded
        sampled requests still running), ``errors`` (request id -> message)."""
        while not (self._outbox or self._errors):
            self._wake.clear()
            await self._wake.wait()
        outputs, self._outbox = self._outbox, []
        errors, self._errors = self._errors, {}
        deltas = [self._delta(o) for o in outputs]
        states = {}
        for rid in {o.request_id for o in outputs if not o.finished}:
            req = self.engine.scheduler.find(rid)
            if req is not None and req.generator is not None and not req.sampling.greedy:
                states[rid] = req.generator.get_state()
        return {"outputs": deltas, "states": states, "errors": errors}

    def _delta(self, out) -> dict:
        sent = self._text_sent.pop(out.request_id, 0)
        delta = {"request_id": out.request_id, "new_token_ids": out.new_token_ids, "finished": out.finished,
                 "finish_reason": out.finish_reason, "metrics": out.metrics, "step": out.step,
                 # log-probabilities (when asked): the new tokens' only, and the prompt's once
                 "logprobs": out.logprobs[len(out.logprobs) - len(out.new_token_ids):] if out.logprobs else None,
                 "prompt_logprobs": out.prompt_logprobs if len(out.token_ids) == len(out.new_token_ids) else None}
        if out.finished:
            delta["text"] = out.text  # a stop string may have cut text sent before
        else:
            delta["text_delta"] = out.text[sent:]
            self._text_sent[out.request_id] = len(out.text)
        return delta

    async def abort(self, request_id: str) -> bool:
        async with self._lock:  # never between a step's verify and its commit
            self._text_sent.pop(request_id, None)
            return self.engine.abort(request_id) is not None

    def describe(self) -> dict:
        """Which driver, executor and proposer classes this worker runs (tests, operations)."""
        name = lambda obj: f"{type(obj).__module__}.{type(obj).__qualname__}"  # noqa: E731
        proposers = {m: name(self.engine.proposers.get(m)) for m in self.engine.limits.methods
                     if self.engine.proposers.get(m) is not None}
        return {"driver": name(self.engine.driver), "executor": name(self.engine.executor), "proposers": proposers}

    def proposer_handles(self) -> dict:
        return {m: p.handle for m, p in self.remote.items()}

    def phase_seconds(self, reset: bool = True) -> dict:
        """Seconds the driver waited for drafts and verified, and its steps (since the last reset)."""
        out = dict(self.engine.driver.phase_seconds)
        if reset:
            self.engine.driver.phase_seconds = {"propose": 0.0, "verify": 0.0, "steps": 0}
        return out

    def overlap_stats(self) -> dict:
        """Per remote method: rows served by a draft made during the previous verification."""
        return {m: {"hits": p.hits, "rows": p.rows} for m, p in self.remote.items()}

    def restarts(self) -> dict:
        return {m: p.restarts for m, p in self.remote.items()}
