"""A proposer in an actor of its own, seen by the engine as a proposer (a proxy).

``propose`` returns an awaitable (the driver awaits it while local proposers run).
``prefill``/``commit``/``release`` are not calls of their own: they wait in the proxy, in
order, and travel with the next ``propose`` (applied before it drafts), so a step costs the
worker one actor call, not two (``load_version`` goes at once, after what waited). An actor
call is a round trip of its own (gRPC both ways, serialization on both sides), whatever its
size; a step's commit rides on the next step's propose for free. A long run of steps with
nothing to draft (the rows held at k = 0) sends what waited in one call of its own every
``FLUSH_AFTER`` operations, and the engine worker ``flush``es when it runs out of work. (With overlap a step also sends
``propose_ahead``, which carries what waited as well.)

Faults cost only speed: a worker that is still loading, or that died, answers ``None``
(its rows decode plainly this step — the same greedy output); a dead one is replaced, and
speculation resumes once the new one is ready.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Sequence

import ray
from ray.exceptions import RayActorError

from specray.actors.proposer_worker import ProposerWorker
from specray.policies.base import Draft

log = logging.getLogger(__name__)

FLUSH_AFTER = 64  # operations waiting for a propose before they go in a call of their own


class Supervised:
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
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.restarts += 1
        self._spawn()


class RemoteProposer(Supervised):
    """A ``ProposerWorker`` for ``method`` with the given actor options (its bundle).

    What crosses to the worker stays proportional to what a step adds: each slot's tokens
    travel once (rows carry only the tokens the worker has not seen). With ``overlap``, as
    soon as a step's drafts are back the worker is asked to draft the next step already
    (``propose_ahead``: assuming every draft token is accepted and its own guess of the
    bonus token), so that it works while the target verifies; at the next step the rows
    whose guess came true take that draft without waiting, and only the others are drafted
    then. Lossless either way: a draft is only ever a proposal.
    """

    def __init__(self, method: str, config, options: dict, vocab_size: int, capacity: int, overlap: bool = False,
                 paging=None):
        cls = ray.remote(ProposerWorker)
        self.overlap = overlap
        self.hits = self.rows = 0
        self._sent: dict[int, int] = {}
        self._ahead = None  # ObjectRef: slot -> (assumed tokens, draft), made during verification
        self._ahead_len: dict[int, int] = {}  # slot -> its token count when that was asked
        super().__init__(method, lambda: cls.options(**options).remote(method, config, vocab_size, capacity, paging))

    def _spawn(self) -> None:
        super()._spawn()
        # A new worker has seen nothing: what waited for the lost one is dropped with it.
        self._sent, self._ahead, self._ahead_len, self._pending = {}, None, {}, []

    def _queue(self, op: str, arg) -> None:
        self._pending.append((op, arg))
        if len(self._pending) >= FLUSH_AFTER:
            self.flush()

    def _take(self) -> list:
        ops, self._pending = self._pending, []
        return ops

    def flush(self) -> None:
        """Send what waits now (the engine went idle: the last requests' releases free the
        worker's state without waiting for a next step)."""
        if self._pending:
            self.handle.apply.remote(self._take())

    def _tails(self, rows: Sequence) -> list:
        out = []
        for r in rows:
            offset = self._sent.get(r.slot, 0)
            if offset > len(r.token_ids):  # a new request in a reused slot
                offset = 0
            self._sent[r.slot] = len(r.token_ids)
            # The request's generator stays with the engine (see ProposerWorker).
            out.append((offset, replace(r, token_ids=list(r.token_ids[offset:]), generator=None)))
        return out

    def propose(self, rows: Sequence):
        if not self.ready():
            return None  # still loading: plain decoding for its rows this step
        return self._propose(list(rows))

    async def _propose(self, rows: list):
        try:
            ref, self._ahead = self._ahead, None  # taken first: a failed one is not awaited again next step
            ahead = await ref if ref is not None else {}
            drafts = [None] * len(rows)
            missing = []
            for i, r in enumerate(rows):
                made = ahead.get(r.slot)
                n = len(made[0]) if made else 0
                if made and len(r.token_ids) == self._ahead_len.get(r.slot, -1) + n and list(r.token_ids[-n:]) == made[0]:
                    drafts[i] = made[1].cut(r.num_tokens)
                else:
                    missing.append(i)
            self.rows += len(rows)
            self.hits += len(rows) - len(missing)
            if missing:
                part = await self.handle.propose.remote(self._take(), self._tails([rows[i] for i in missing]))
                for i, row in zip(missing, part.rows):
                    drafts[i] = row
            result = Draft(drafts)
            if self.overlap:
                self._ahead_len = {r.slot: len(r.token_ids) for r in rows}
                self._ahead = self.handle.propose_ahead.remote(self._take(), self._tails(rows), result)
            return result
        except RayActorError:
            self.replace()
            return None

    def prefill(self, rows) -> None:
        self._queue("prefill", rows)

    def commit(self, rows) -> None:
        self._queue("commit", rows)

    def load_version(self, state: dict) -> None:
        """A new drafter version (between steps): the worker swaps it in and rebuilds its slots;
        a draft made ahead with the old one is dropped."""
        self._ahead, self._ahead_len = None, {}
        # Sent at once, after what waited: versions are rare and their weights large, so none
        # waits in the proxy (several could pile up while nothing drafts).
        self._queue("load_version", state)
        self.flush()

    def release(self, slot: int) -> None:
        self._sent.pop(slot, None)
        self._ahead_len.pop(slot, None)
        self._queue("release", [slot])
