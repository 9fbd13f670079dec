"""Request bookkeeping shared by the local engine and the Ray coordinator.

Pure CPU code, no models: validation of new requests, the waiting queue, slot
assignment (a request keeps its KV-cache row from admission to finish), abort.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from specray.engine.metrics import SpecMetrics
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.request import Request, RequestOutput
from specray.policies.base import registered_methods

PLAIN = "none"


def check_method_name(method: str) -> None:
    """Raise ValueError unless ``method`` is 'none' or a registered proposer."""
    if method != PLAIN and method not in registered_methods():
        raise ValueError(f"unknown speculation method {method!r}; known: {[PLAIN] + registered_methods()}")


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the target (and whether a draft exists)."""

    capacity: int  # tokens per sequence (context)
    vocab_size: int
    eos_ids: frozenset[int]
    has_draft: bool
    medusa_heads: int = 0  # 0 = no Medusa heads loaded


class Scheduler:
    def __init__(self, num_slots: int, limits: ModelLimits, tokenizer=None,
                 default_speculation: SpeculationParams | None = None):
        self.limits = limits
        self.tokenizer = tokenizer
        self.default_speculation = default_speculation or SpeculationParams()
        self.free_slots = list(range(num_slots))
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.totals = SpecMetrics()
        self._ids = itertools.count()

    def check_method(self, method: str) -> None:
        check_method_name(method)
        if method == "draft" and not self.limits.has_draft:
            raise ValueError("method 'draft' needs a draft model (EngineConfig.draft)")
        if method == "medusa" and not self.limits.medusa_heads:
            raise ValueError("method 'medusa' needs Medusa heads (EngineConfig.medusa; `specray train medusa`)")

    def make_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        speculation: SpeculationParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Validate and build a request (ValueError with a clear message if bad)."""
        sampling = sampling or SamplingParams()
        speculation = speculation or self.default_speculation
        self.check_method(speculation.method)
        if speculation.method == "medusa":
            from specray.policies.medusa import resolve_tree

            resolve_tree(speculation.model_dump(), self.limits.medusa_heads)  # depth vs heads
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
