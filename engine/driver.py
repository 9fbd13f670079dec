"""The one step driver: admit -> prefill -> plan -> propose -> verify -> accept -> commit.

Every layout runs this code: the in-process ``LLMEngine`` and the Ray engine worker (which
holds the target) differ only in their ``Executor`` — where the target and each proposer
run. The driver is a coroutine so that an executor may wait on remote proposers (Ray
ObjectRefs) without blocking its actor; an in-process executor never suspends, and
``run_sync`` drives it without an event loop.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass, replace
from typing import Mapping, Protocol, Sequence

import torch

from specray.engine import logprobs as L
from specray.engine import step as S
from specray.engine.request import Request, RequestOutput
from specray.engine.scheduler import Scheduler
from specray.engine.device_step import verify_on_device
from specray.engine.verify import TargetScores, Verified, accept_verified, sampled_rows
from specray.kernels.sampling import sample
from specray.policies.base import Draft, DraftRow, PrefillRow
from specray.policies.registry import method_spec, registered_methods
from specray.policies.controller import AdaptiveSpeculation
from specray.policies.spec_length import SpeculationLengthPolicy

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Where a step's work runs (the target and each method's proposer)."""

    async def prefill(self, reqs: Sequence[Request], sampled: Sequence[int]) -> TargetScores:
        """Run the admitted prompts through the target: scores at each last prompt token."""

    async def propose(self, plan: S.ProposalPlan) -> Mapping[str, Draft | None]:
        """Each method's draft for its rows (None: that proposer is unavailable this step)."""

    async def verify(self, reqs: Sequence[Request], drafts: Sequence[DraftRow]) -> Verified:
        """One target forward over every row's root + nodes, and acceptance."""

    def apply(self, commit: S.Commit) -> None:
        """Keep each row's accepted path in the target; tell proposers what was kept."""

    def release(self, slots: Sequence[int]) -> None:
        """These slots' requests are gone."""


class StepDriver:
    """Continuous batching over an executor: requests join and leave between steps."""

    def __init__(self, scheduler: Scheduler, executor: Executor, capacity: int, tokenizer=None,
                 length_policy: SpeculationLengthPolicy | AdaptiveSpeculation | None = None):
        self.scheduler, self.executor = scheduler, executor
        self.capacity, self.tokenizer = capacity, tokenizer
        # How many nodes each row drafts: learned online (default), or static caps.
        self.length_policy = length_policy if length_policy is not None else AdaptiveSpeculation()
        # Seconds spent waiting for drafts and verifying, and steps (benchmarks read them).
        self.phase_seconds = {"propose": 0.0, "verify": 0.0, "steps": 0}

    async def step(self) -> list[RequestOutput]:
        """Admit waiting requests (one ragged prefill), then one speculative step over the rest."""
        joining = self.scheduler.admit()
        outputs = await self._prefill(joining) if joining else []
        fresh = {r.request_id for r in joining}
        batch = [r for r in self.scheduler.running.values() if r.request_id not in fresh]
        if batch:
            outputs += await self._speculate(batch)
        return outputs

    async def _prefill(self, reqs: list[Request]) -> list[RequestOutput]:
        # Resumed requests (moved from a lost worker) already have their root: nothing is sampled.
        sampled = [i for i in sampled_rows(reqs) if not reqs[i].output_ids]
        scores = await self.executor.prefill(reqs, sampled)
        tokens = [None if r.output_ids else t for r, t in zip(reqs, first_tokens(reqs, scores))]
        return self._apply(S.commit_prefill(reqs, tokens, self.capacity, self.tokenizer, scores))

    async def _speculate(self, batch: list[Request]) -> list[RequestOutput]:
        start = time.perf_counter()
        views = [S.row_view(r) for r in batch]
        plan = S.plan_proposals(batch, self.capacity, self.length_policy.caps(views))
        drafts = S.merge_drafts(batch, plan, await self.executor.propose(plan))
        proposed = time.perf_counter()
        verified = await self.executor.verify(batch, drafts)
        self.phase_seconds["propose"] += proposed - start
        self.phase_seconds["verify"] += time.perf_counter() - proposed
        self.phase_seconds["steps"] += 1
        outputs = self._apply(S.commit_step(batch, verified, self.capacity, self.tokenizer))
        self.length_policy.observe(views, [d.size for d in drafts], verified.result.num_accepted,
                                   time.perf_counter() - start)
        return outputs

    def _apply(self, commit: S.Commit) -> list[RequestOutput]:
        self.executor.apply(commit)
        for r in commit.finished:
            self.release(r)
        return commit.outputs

    def release(self, r: Request) -> None:
        """Free a finished or aborted request's slot and its workers' state."""
        if self.scheduler.release(r):
            self.executor.release([r.slot])
            self.length_policy.release(r.request_id)


def first_tokens(reqs: Sequence[Request], scores: TargetScores) -> list[int]:
    """Each admitted request's first token, from the target's scores at its last prompt token."""
    tokens = [row[0] for row in scores.best]
    if scores.sampled:
        probs = scores.probs(reqs)[:, 0]
        for i, tok in zip(scores.sampled, sample(probs, [reqs[i].generator for i in scores.sampled]).tolist()):
            tokens[i] = tok
    return tokens


def run_sync(coro):
    """Run a coroutine that never suspends (an in-process executor) to completion."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("the step waited on a remote worker: run it in an event loop (an async actor)")


class LocalExecutor:
    """The target's runner in this process, and each method's proposer (local objects, or
    remote proxies whose ``propose`` returns an awaitable). Proposers that read features sit
    here, beside the target: the hidden states of the last forward never leave the device.

    With a fixed-shape target (``target.static``, ``engine/graphs.py``), verification and
    acceptance run on the device with one read-back per step (``engine/device_step.py``),
    and proposers that can draft on the device (``propose_on_device``) do so; else the
    eager forward and host acceptance (the reference)."""

    def __init__(self, target, proposers: "ProposerTable"):
        self.target = target
        self.proposers = proposers
        self._last = None  # the last forward's features (final norm's, layer taps) rows' methods read
        self._device_parts: dict = {}  # method -> (batch indices, DeviceDraft) of this step
        self._compacted = False  # the last verification kept its paths in the cache already

    async def prefill(self, reqs, sampled):
        for r in reqs:
            self.target.reset(r.slot)
        every = L.every_position(reqs) if L.wants_prompt(reqs) else None  # echo: score the prompt too
        out = self.target.forward([r.slot for r in reqs], [r.prefill_ids for r in reqs], every,
                                  **self._wants_features(reqs))
        self._last = out
        logits, prompts = L.split_prefill(out.logits, reqs) if every is not None else (out.logits, {})
        return replace(TargetScores.from_logits(logits, sampled, L.wanted(reqs)), prompt_logprobs=prompts)

    async def propose(self, plan):
        pending, parts = {}, {}
        # Local proposers draft here; a remote proxy returns an awaitable, awaited after them
        # (with overlap on, its worker has been drafting ahead since the last verification).
        self._device_parts = {}
        for method, (idx, rows) in plan.rows.items():
            proposer = self.proposers.get(method)
            if proposer is not None and self._device_step and hasattr(proposer, "propose_on_device"):
                part = proposer.propose_on_device(rows)
                if part is not None:
                    parts[method] = part
                    self._device_parts[method] = (idx, part)
                    continue
            parts[method] = proposer.propose(rows) if proposer is not None else None
            if inspect.isawaitable(parts[method]):
                pending[method] = parts.pop(method)
        for method, awaitable in pending.items():
            parts[method] = await awaitable  # a remote proxy answers None when its worker is down
        return parts

    async def verify(self, reqs, drafts):
        if self._device_step:
            done = verify_on_device(self.target, reqs, drafts, self._device_parts)
            self._device_parts, self._compacted = {}, True
            self._last = _Features(done.features, done.layers) if any(self._wants_features(reqs).values()) else None
            return done.verified
        inputs = S.verify_inputs(reqs, drafts)
        out = self.target.forward([r.slot for r in reqs], inputs.tokens, inputs.logits_at, inputs.layout,
                                  **self._wants_features(reqs))
        self._last = out
        return accept_verified(reqs, drafts, TargetScores.from_logits(out.logits, sampled_rows(reqs), L.wanted(reqs)))

    def apply(self, commit):
        if self._compacted:  # the device kept the paths; the host learns the lengths
            for slot, base, path in commit.target_keep:
                self.target.set_length(slot, base + len(path))
            self._compacted = False
        else:
            self.target.keep(commit.target_keep)
        for method, rows in commit.proposer_rows.items():
            proposer = self.proposers.get(method)
            if proposer is None:
                continue
            if method_spec(method).needs_features:
                rows = [(i, _with_features(row, self._row_features(method, i))) for i, row in rows]
            prefill = [row for _, row in rows if isinstance(row, PrefillRow)]
            commits = [row for _, row in rows if not isinstance(row, PrefillRow)]
            if prefill and hasattr(proposer, "prefill"):
                proposer.prefill(prefill)
            if commits:
                proposer.commit(commits)
        self._last = None

    def release(self, slots):
        for s in slots:
            self.target.reset(s)
        self.proposers.release(slots)

    @property
    def _device_step(self) -> bool:
        return self.target.static is not None

    def _wants_features(self, reqs) -> dict:
        """The forward's feature arguments: the final norm's and/or the layers the batch's methods read."""
        final, layers = False, set()
        for method in {r.method for r in reqs}:
            if method_spec(method).needs_features:
                taps = self.proposers.feature_layers(method)
                final |= taps is None
                layers.update(taps or ())
        return {"features": final, "layers": tuple(sorted(layers))}

    def _row_features(self, method: str, i: int):
        """Row i's features of the last forward as ``method`` reads them: [q, H] or [q, n*H]."""
        taps = self.proposers.feature_layers(method)
        if taps is None:
            return self._last.features[i]
        return torch.cat([self._last.layers[k][i] for k in taps], dim=-1)


@dataclass
class _Features:
    features: torch.Tensor | None  # [B, q, H] final norm's
    layers: Mapping[int, torch.Tensor] | None  # {k: [B, q, H]}


def _with_features(row, feats):  # feats: [q, F] the row's new positions
    if isinstance(row, PrefillRow):
        return replace(row, features=feats[: len(row.token_ids)])
    return replace(row, features=feats[row.path])


class ProposerTable:
    """Each method's proposer in this engine, built on first use from its spec.

    ``overrides`` are proposers supplied from outside (Ray proxies to workers of their own).
    """

    def __init__(self, context, resources: Mapping[str, object], overrides: Mapping[str, object] | None = None):
        self.context, self.resources = context, dict(resources)
        self._built: dict[str, object] = dict(overrides or {})

    def get(self, method: str):
        if method not in self._built:
            spec = method_spec(method)
            if spec.build is None:
                return None
            if spec.checkpoint is not None and method not in self.resources:
                return None
            self._built[method] = spec.build(replace(self.context, resource=self.resources.get(method)))
        return self._built[method]

    def feature_layers(self, method: str) -> tuple[int, ...] | None:
        """The target layers whose inputs ``method`` reads (None: the final norm's features)."""
        spec = method_spec(method)
        if spec.feature_layers is None or self.get(method) is None:  # built first: it may resolve them
            return None
        return tuple(spec.feature_layers(self.resources[method]))

    def all_feature_layers(self) -> tuple[int, ...]:
        """Every target layer a loaded method reads (``MethodSpec.feature_layers``)."""
        taps = set()
        for m in self.resources:
            if m in registered_methods() and method_spec(m).feature_layers is not None:
                taps.update(self.feature_layers(m) or ())
        return tuple(sorted(taps))

    def release(self, slots: Sequence[int]) -> None:
        for proposer in self._built.values():
            for s in slots:
                proposer.release(s)
