"""Admission: whether a request runs, decided once for the whole request.

A request is admitted whole or refused whole, before any of it runs. Its cost is what it
asks the engine to hold (``RequestCost``: sequences = prompts x ``n``, and their tokens);
the load is what the engine already holds (``Load``). ``AdmissionPolicy`` is the one place
that turns the two into a ``Decision``:

* ``check(cost)`` — what no amount of waiting changes: more sequences than
  ``max_sequences_per_request`` is a 400 naming that limit (the client must split the
  request). The HTTP ingress calls it as soon as a request is checked, before it is sent
  anywhere.
* ``admit(cost, load)`` — ``check`` and then the load: a 503 with ``retry_after_s`` when the
  queue of waiting sequences is full now (transient: it drains). A request that arrives to
  an empty queue is always admitted, so any request that passes ``check`` runs eventually;
  OpenAI's 2,048 prompts in one request are queued and run like vLLM queues them. The engine
  deployment (one per Serve replica) calls it with its own load, then submits every sequence
  of the request at once.

Extending it (e.g. paged KV admitting by free blocks): add the resource to ``RequestCost``
(its tokens are already there) and ``Load``, subclass the policy and refine ``admit`` —
``super().admit(...)`` first, then refuse with ``Decision.busy`` when the blocks are short
now, or ``Decision.never`` when the request could not fit even in an empty engine. The
callers read only ``Decision``, so they do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

RETRY_AFTER_S = 1.0  # what a 503 tells a client to wait: a step or a few frees sequences


@dataclass(frozen=True)
class RequestCost:
    """What one request asks the engine to hold."""

    sequences: int  # prompts x n: each runs as its own sequence
    prompt_tokens: int = 0  # summed over its sequences
    max_new_tokens: int = 0  # summed over its sequences

    @classmethod
    def of(cls, prompt_sizes: list[int], n: int, max_tokens: list[int] | None = None) -> "RequestCost":
        """A request of these prompts (their token counts), each asked for ``n`` choices."""
        return cls(len(prompt_sizes) * n, sum(prompt_sizes) * n, sum(max_tokens or []) * n)


@dataclass(frozen=True)
class Load:
    """What the engine holds now, in sequences."""

    waiting: int = 0  # admitted, not yet in the running batch
    running: int = 0


@dataclass(frozen=True)
class Decision:
    """Admitted, or refused with an HTTP status in OpenAI's error shape."""

    admitted: bool
    status: int = 200  # 400: never admissible as sent; 503: not now (retry after retry_after_s)
    message: str = ""
    kind: str = ""  # OpenAI's error type
    param: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def admit(cls) -> "Decision":
        return cls(True)

    @classmethod
    def never(cls, message: str, param: str | None = None) -> "Decision":
        return cls(False, 400, message, "invalid_request_error", param)

    @classmethod
    def busy(cls, message: str, retry_after_s: float = RETRY_AFTER_S) -> "Decision":
        return cls(False, 503, message, "overloaded", None, retry_after_s)


class AdmissionPolicy:
    """Admit a request whole, or refuse it whole (module docstring).

    max_sequences_per_request: most sequences (prompts x n) one request may ask for.
    max_waiting_sequences: while more than this many sequences wait beyond the running batch,
    a new request is refused with a 503 (a request arriving to an empty queue never is).
    """

    def __init__(self, max_sequences_per_request: int, max_waiting_sequences: int):
        self.max_sequences_per_request = max_sequences_per_request
        self.max_waiting_sequences = max_waiting_sequences

    def check(self, cost: RequestCost, param: str | None = "prompt") -> Decision:
        """What the load does not change: a request over the per-request limit never runs."""
        if cost.sequences > self.max_sequences_per_request:
            return Decision.never(
                f"this request asks for {cost.sequences} sequences (prompts x n); this server runs at most "
                f"{self.max_sequences_per_request} per request (max_sequences_per_request): split it", param)
        return Decision.admit()

    def admit(self, cost: RequestCost, load: Load, param: str | None = "prompt") -> Decision:
        """``check``, then whether the engine takes it now."""
        decision = self.check(cost, param)
        if not decision.admitted:
            return decision
        if load.waiting and load.waiting + cost.sequences > self.max_waiting_sequences:
            return Decision.busy(f"server busy: {load.waiting} sequences already waiting (at most "
                                 f"{self.max_waiting_sequences}); retry later")
        return decision
