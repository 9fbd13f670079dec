"""A proposer in an actor of its own, seen by the engine as a proposer (a proxy).

``propose`` returns an awaitable (the driver awaits it while local proposers run);
``prefill``/``commit``/``release`` are fire-and-forget (Ray keeps one caller's calls to an
actor in order, so a commit always lands before the next propose).

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

log = logging.getLogger(__name__)


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
    """A ``ProposerWorker`` for ``method`` with the given actor options (its bundle)."""

    def __init__(self, method: str, config, options: dict, vocab_size: int, capacity: int):
        from specray.actors.workers import ProposerWorker

        cls = ray.remote(ProposerWorker)
        super().__init__(method, lambda: cls.options(**options).remote(method, config, vocab_size, capacity))

    def propose(self, rows: Sequence):
        if not self.ready():
            return None  # still loading: plain decoding for its rows this step
        # The request's generator stays with the engine (see ProposerWorker).
        ref = self.handle.propose.remote([replace(r, generator=None) for r in rows])
        return self._await(ref)

    async def _await(self, ref):
        try:
            return await ref
        except RayActorError:
            self.replace()
            return None

    def prefill(self, rows) -> None:
        self.handle.prefill.remote(rows)

    def commit(self, rows) -> None:
        self.handle.commit.remote(rows)

    def release(self, slot: int) -> None:
        self.handle.release.remote([slot])
