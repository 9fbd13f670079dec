"""The engine's request bookkeeping: it only schedules.

Pure CPU code, no models: the waiting queue, slot assignment (a request keeps its KV-cache
row from admission to finish), abort. Requests arrive made (validated, tokenised) by
``engine/intake.py``.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Callable

from specray.engine.metrics import SpecMetrics
from specray.engine.request import Request, RequestOutput


class Scheduler:
    """FIFO admission of waiting requests to ``num_slots`` KV-cache rows."""

    def __init__(self, num_slots: int):
        self.free_slots = list(range(num_slots))
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.totals = SpecMetrics()
        self.preemptions = 0
        self._admitted = itertools.count()  # admission order: the newest running request is preempted first

    def add(self, request: Request) -> str:
        self.waiting.append(request)
        return request.request_id

    def admit(self, fits: Callable[[Request], bool] | None = None) -> list[Request]:
        """Give free slots to waiting requests (FIFO) while ``fits`` says the next one's KV fits
        (paged KV: its blocks are free; it may count what it admits); returns the admitted."""
        joining = []
        while self.waiting and self.free_slots and (fits is None or fits(self.waiting[0])):
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            req.admitted = next(self._admitted)
            self.running[req.slot] = req
            joining.append(req)
        return joining

    def preempt(self, req: Request) -> None:
        """Take a running request out of the batch to free its KV (the caller frees its workers'
        state): it waits at the head of the queue with everything it emitted, and is recomputed
        when admitted again (its prompt and output prefilled; nothing is sampled then)."""
        del self.running[req.slot]
        self.free_slots.append(req.slot)
        self.free_slots.sort()
        req.slot = -1
        req.metrics.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def release(self, req: Request) -> bool:
        """Free a finished/aborted request's slot; False if it held none."""
        if self.running.get(req.slot) is not req:
            return False
        del self.running[req.slot]
        self.free_slots.append(req.slot)
        self.free_slots.sort()
        self.totals.merge(req.metrics)
        return True

    def find(self, request_id: str) -> Request | None:
        for req in itertools.chain(self.waiting, self.running.values()):
            if req.request_id == request_id:
                return req
        return None

    def request_ids(self) -> list[str]:
        return [r.request_id for r in itertools.chain(self.running.values(), self.waiting)]

    def abort(self, request_id: str, release, error: str | None = None) -> RequestOutput | None:
        """Stop a request; ``release(req)`` frees a running one's workers. Returns its last
        output (finish_reason 'abort', or 'error' with ``error``), or None if no such request
        is queued or running."""
        req = self.find(request_id)
        if req is None:
            return None
        if error is None:
            req.finish_reason = "abort"
        else:
            req.fail(error)
        if req.slot < 0:
            self.waiting.remove(req)
        else:
            release(req)
        return req.output([])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
