"""The one step driver: admit -> prefill -> plan -> propose -> verify -> accept -> commit.

Every layout runs this code: the in-process ``LLMEngine`` and the Ray engine worker (which
holds the target) differ only in their ``Executor`` — where the target and each proposer
run. The driver is a coroutine so that an executor may wait on remote proposers (Ray
ObjectRefs) without blocking its actor; an in-process executor never suspends, and
``run_sync`` drives it without an event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Mapping, Protocol, Sequence

from specray.engine import step as S
from specray.engine.request import Request, RequestOutput
from specray.engine.scheduler import Scheduler
from specray.engine.accept import TargetScores, Verified, sampled_rows
from specray.engine.collectives import GroupLostError
from specray.engine.grammar import ForcedRow, forced_drafts, with_forced
from specray.kernels.sampling import sample
from specray.policies.base import Draft, DraftRow
from specray.policies.registry import PLAIN
from specray.policies.budget import StepRecord, VerificationBudget
from specray.policies.spec_length import SpeculationLengthPolicy

log = logging.getLogger(__name__)


class Executor(Protocol):
    """Where a step's work runs (the target and each method's proposer).

    Failures are contained row by row (a proposer or a verification that raises fails the
    requests it concerns, never the engine): ``propose`` retries a method whose batch
    raised one row at a time and reports the rows that still raise (``failed_rows``; they
    decode plainly this step), ``verify`` leaves the target as it was when it raises (the
    driver then verifies row by row), and ``apply`` reports the slots whose proposer
    hooks raised. A lost tensor-parallel group (``GroupLostError``) is no row's failure: it
    leaves the step, and the replica is rebuilt (``actors/engine_worker.py``)."""

    async def prefill(self, reqs: Sequence[Request], sampled: Sequence[int]) -> TargetScores:
        """Run the admitted prompts through the target: scores at each last prompt token."""

    async def propose(self, plan: S.ProposalPlan) -> Mapping[str, Draft | None]:
        """Each method's draft for its rows (None: that proposer is unavailable this step)."""

    def failed_rows(self) -> Mapping[int, BaseException]:
        """Batch rows whose proposer raised in the last ``propose`` (their drafts are empty)."""

    async def verify(self, reqs: Sequence[Request], drafts: Sequence[DraftRow]) -> Verified:
        """One target forward over every row's root + nodes, and acceptance."""

    def recover(self, reqs: Sequence[Request], drafts: Sequence[DraftRow]) -> list[DraftRow]:
        """After a failed ``verify``: the drafts with every token on the host (to retry per row)."""

    def apply(self, commit: S.Commit) -> Mapping[int, BaseException] | None:
        """Keep each row's accepted path in the target; tell proposers what was kept. Returns
        the slots whose proposer hooks raised."""

    def release(self, slots: Sequence[int]) -> None:
        """These slots' requests are gone."""

    # Optional: drafts_on_device(method) -> bool: the method's drafts stay on the device until
    # the verification (rows whose grammar forces tokens then draft only those).
    # Paged KV (optional: executors without them run unpaged):
    #   fits() -> None | (Request -> bool): admission by the target's free blocks
    #   reserve(reqs, drafts) -> [batch rows the pool could not give room to verify]


class StepDriver:
    """Continuous batching over an executor: requests join and leave between steps."""

    def __init__(self, scheduler: Scheduler, executor: Executor, capacity: int, tokenizer=None,
                 length_policy: SpeculationLengthPolicy | VerificationBudget | None = None,
                 clock: Callable[[], float] = time.perf_counter, grammar_drafter: bool = True):
        self.scheduler, self.executor = scheduler, executor
        self.capacity, self.tokenizer = capacity, tokenizer
        # What a step's cost is measured in (the length policy learns from it): wall seconds,
        # or (LLMEngine decides) the process's CPU seconds where that is all a step costs.
        self.clock = clock
        # How many nodes each row drafts: the verification budget (default), or static caps.
        self.length_policy = length_policy if length_policy is not None else VerificationBudget()
        # Structured outputs: the tokens a row's grammar forces are its draft (engine/grammar.py).
        self.grammar_drafter = grammar_drafter
        # Seconds spent waiting for drafts and verifying, and steps (benchmarks read them).
        self.phase_seconds = {"propose": 0.0, "verify": 0.0, "steps": 0}

    async def step(self) -> list[RequestOutput]:
        """Admit waiting requests (one ragged prefill), then one speculative step over the rest."""
        fits = getattr(self.executor, "fits", None)
        joining = self.scheduler.admit(fits() if fits is not None else None)
        outputs = await self._prefill(joining) if joining else []
        fresh = {r.request_id for r in joining}
        batch = [r for r in self.scheduler.running.values() if r.request_id not in fresh]
        if batch:
            outputs += await self._speculate(batch)
        return outputs

    async def _prefill(self, reqs: list[Request]) -> list[RequestOutput]:
        # Resumed requests (moved from a lost worker) already have their root: nothing is sampled.
        sampled = [i for i in sampled_rows(reqs) if not reqs[i].output_ids]
        try:
            scores = await self.executor.prefill(reqs, sampled)
        except GroupLostError:  # the replica is lost, not a row: its worker is replaced
            raise
        except Exception as exc:  # noqa: BLE001 - contained: only the rows that raise alone fail
            if len(reqs) == 1:
                return [self.fail(reqs[0], exc)]
            return [out for r in reqs for out in await self._prefill([r])]
        tokens = [None if r.output_ids else t for r, t in zip(reqs, first_tokens(reqs, scores))]
        return self._apply(S.commit_prefill(reqs, tokens, self.capacity, self.tokenizer, scores))

    async def _speculate(self, batch: list[Request]) -> list[RequestOutput]:
        start, cost = time.perf_counter(), self.clock()
        views = [S.row_view(r) for r in batch]
        context = sum(r.num_tokens for r in batch) / len(batch)
        forced = forced_drafts(batch, self.capacity) if self.grammar_drafter else None
        if forced is not None and any(forced):  # verified whatever the caps: the budget prices them in
            caps = self.length_policy.caps(views, context, [f.size if f else 0 for f in forced])
        else:
            caps = self.length_policy.caps(views, context)
        if forced is not None and any(forced):  # rows whose method would draft on the device draft nothing else
            on_device = getattr(self.executor, "drafts_on_device", lambda method: False)
            caps = [0 if f and on_device(r.method) else c for r, f, c in zip(batch, forced, caps)]
        plan = S.plan_proposals(batch, self.capacity, caps)
        parts = await self.executor.propose(plan)
        drafts = S.merge_drafts(batch, plan, parts)
        if any(getattr(d, "confidence", None) for d in drafts) and hasattr(self.length_policy, "trim"):
            sizes = self.length_policy.trim(views, [d.size for d in drafts], [getattr(d, "confidence", None) for d in drafts])
            drafts = [d.cut(n) for d, n in zip(drafts, sizes)]
        if forced is not None and any(forced):
            drafts = with_forced(drafts, forced, S.device_rows(plan, parts))
        failed = dict(self.executor.failed_rows()) if hasattr(self.executor, "failed_rows") else {}
        failed = {batch[i].slot: exc for i, exc in failed.items()}
        batch, drafts, views, ended = self._make_room(batch, drafts, views)
        if not batch:
            return ended
        proposed, drafted_at = time.perf_counter(), self.clock()
        try:
            verified = await self.executor.verify(batch, drafts)
        except GroupLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - contained: verify row by row
            outputs = await self._verify_alone(batch, drafts, exc)
        else:
            self.phase_seconds["propose"] += proposed - start
            self.phase_seconds["verify"] += time.perf_counter() - proposed
            self.phase_seconds["steps"] += 1
            outputs = self._apply(S.commit_step(batch, verified, self.capacity, self.tokenizer))
            self.length_policy.observe(StepRecord(
                _method_views(views, verified.drafts), [d.size for d in verified.drafts], verified.result.num_accepted,
                verified.result.paths,
                [None if d.is_chain else d.structure.parents.numpy()[1:].tolist() for d in verified.drafts],
                propose_s=drafted_at - cost, verify_s=self.clock() - drafted_at, context=context))
        return ended + self._fail_after(outputs, failed)

    def _make_room(self, batch: list[Request], drafts: list[DraftRow], views: list):
        """Paged KV: blocks for everything this step verifies. While the target's pool cannot
        hold it, the newest running request is preempted (its KV freed; it waits at the head
        of the queue with what it emitted and is recomputed later), so that no request fails
        for want of KV while others can finish. A request alone that still does not fit
        verifies without its draft, and if even that does not fit it finishes with 'length'.
        Returns the batch, drafts and views that verify, and outputs of requests that ended."""
        reserve = getattr(self.executor, "reserve", None)
        ended: list[RequestOutput] = []
        while batch and reserve is not None:
            short = reserve(batch, drafts)
            if not short:
                break
            # Rows leave the batch: drafts made on the device are read back first (the device
            # step indexes its drafts by batch row).
            drafts = list(self.executor.recover(batch, drafts))
            if len(batch) > 1:
                i = max(range(len(batch)), key=lambda j: batch[j].admitted)
                self.preempt(batch[i])
            elif drafts[0].size:
                drafts = [DraftRow([])]
                continue
            else:
                i = 0
                ended.append(self.finish(batch[0], "length"))
            batch, drafts, views = batch[:i] + batch[i + 1:], drafts[:i] + drafts[i + 1:], views[:i] + views[i + 1:]
        return batch, drafts, views, ended

    def preempt(self, r: Request) -> None:
        log.info("request %s preempted: the KV cache is full (recomputed when there is room)", r.request_id)
        self.executor.release([r.slot])
        self.length_policy.release(r.request_id)
        self.scheduler.preempt(r)

    def finish(self, r: Request, reason: str) -> RequestOutput:
        """End a running request now (e.g. 'length': it alone outgrew the KV cache)."""
        r.finish_reason = reason
        self.release(r)
        return r.output([])

    async def _verify_alone(self, batch: list[Request], drafts, exc: BaseException) -> list[RequestOutput]:
        """A verification raised: the target is as it was; verify each row on its own."""
        if len(batch) == 1:
            return [self.fail(batch[0], exc)]
        log.warning("verification of %d rows raised (%s: %s); verifying them one by one",
                    len(batch), type(exc).__name__, exc)
        drafts = self.executor.recover(batch, drafts)
        outputs = []
        for r, d in zip(batch, drafts):
            try:
                verified = await self.executor.verify([r], [d])
            except GroupLostError:
                raise
            except Exception as row_exc:  # noqa: BLE001
                outputs.append(self.fail(r, row_exc))
                continue
            outputs += self._apply(S.commit_step([r], verified, self.capacity, self.tokenizer))
        return outputs

    def _apply(self, commit: S.Commit) -> list[RequestOutput]:
        failed = self.executor.apply(commit) or {}
        for r in commit.finished:
            self.release(r)
        return self._fail_after(commit.outputs, failed)

    def _fail_after(self, outputs: list[RequestOutput], failed: Mapping[int, BaseException]) -> list[RequestOutput]:
        """Rows that raised after they were committed (slot -> error): their output of this
        step is their last, finishing with 'error'."""
        if not failed:
            return outputs
        out = []
        for o in outputs:
            r = self.scheduler.find(o.request_id)
            exc = failed.get(r.slot) if r is not None else None
            out.append(self.fail(r, exc, o.new_token_ids, o.step) if exc is not None else o)
        return out

    def fail(self, r: Request, exc: BaseException, new_tokens: Sequence[int] = (), step=None) -> RequestOutput:
        """Finish a request with 'error' (the message says what raised) and free its slot; the
        engine goes on serving the others."""
        log.error("request %s failed: %s: %s", r.request_id, type(exc).__name__, exc, exc_info=exc)
        r.fail(f"{type(exc).__name__}: {exc}")
        self.release(r)
        return r.output(list(new_tokens), step)

    def release(self, r: Request) -> None:
        """Free a finished or aborted request's slot and its workers' state."""
        if self.scheduler.release(r):
            self.executor.release([r.slot])
            self.length_policy.release(r.request_id)


def _method_views(views: list, drafts: Sequence[DraftRow]) -> list:
    """The rows as the speculation-length policy learns from them: a row that verified its
    grammar's forced tokens drafted nothing of its method's (seen as plain decoding: its
    width still counts in the step's cost, its acceptance not in the method's)."""
    if not any(isinstance(d, ForcedRow) for d in drafts):
        return views
    return [replace(v, method=PLAIN) if isinstance(d, ForcedRow) else v for v, d in zip(views, drafts)]


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
