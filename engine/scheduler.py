"""Request bookkeeping shared by the local engine and the Ray coordinator.

Pure CPU code, no models: validation of new requests, the waiting queue, slot
assignment (a request keeps its KV-cache row from admission to finish), abort.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Sequence

import torch

from specray.engine.metrics import SpecMetrics
from specray.engine.params import SamplingParams
from specray.engine.request import Request, RequestOutput
from specray.policies.registry import Limits, MethodOptions, PlainOptions, validate_speculation


class Scheduler:
    def __init__(self, num_slots: int, limits: Limits, tokenizer=None,
                 default_speculation: MethodOptions | None = None):
        self.limits = limits
        self.tokenizer = tokenizer
        self.default_speculation = default_speculation or PlainOptions()
        self.free_slots = list(range(num_slots))
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.totals = SpecMetrics()
        self._ids = itertools.count()

    def make_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        speculation: MethodOptions | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Validate and build a request (ValueError with a clear message if bad)."""
        sampling = sampling or SamplingParams()
        speculation = speculation or self.default_speculation
        validate_speculation(speculation, self.limits)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        capacity = self.limits.capacity
        if len(prompt_ids) >= capacity:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {capacity} "
                "tokens and generation needs at least one more"
            )
        vocab = self.limits.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.limits.eos_ids)
        return Request(request_id, prompt_ids, sampling, speculation, stop_ids, generator=generator)

    def add(self, request: Request) -> str:
        self.waiting.append(request)
        return request.request_id

    def admit(self) -> list[Request]:
        """Give free slots to waiting requests (FIFO); returns the newly admitted."""
        joining = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            self.running[req.slot] = req
            joining.append(req)
        return joining

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

    def abort(self, request_id: str, release) -> RequestOutput | None:
        """Stop a request; ``release(req)`` frees a running one's workers. Returns its last
        output (finish_reason 'abort'), or None if no such request is queued or running."""
        req = self.find(request_id)
        if req is None:
            return None
        req.finish_reason = "abort"
        if req.slot < 0:
            self.waiting.remove(req)
        else:
            release(req)
        return req.output([])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
