"""Speculation length by batch size: a batch-size table of k caps, and off above a size.

Speculation trades target compute for latency: at small batches the target is
memory-/overhead-bound and verifying k+1 tokens costs about as much as one; at large
batches it is compute-bound and rejected drafts are pure waste. So a busy server must
never speculate itself slower than plain decoding (cf. vLLM's
``speculative_disable_by_batch_size``).

>>> policy = SpeculationLengthPolicy(disable_above_batch=16, batch_k_caps=((4, 3), (8, 2)))
>>> [policy.cap(b) for b in (1, 4, 8, 16, 17)]
[None, 3, 2, 2, 0]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationLengthPolicy:
    disable_above_batch: int | None = None
    """Running batch larger than this: no speculation at all (None = never off)."""
    batch_k_caps: tuple[tuple[int, int], ...] = ()
    """(min_batch, max_k) pairs: from min_batch running rows on, k is at most max_k."""

    def __post_init__(self):
        if self.disable_above_batch is not None and self.disable_above_batch < 1:
            raise ValueError(f"disable_above_batch must be >= 1, got {self.disable_above_batch}")
        for min_batch, max_k in self.batch_k_caps:
            if min_batch < 1 or max_k < 0:
                raise ValueError(f"batch_k_caps entries need min_batch >= 1 and max_k >= 0, got {(min_batch, max_k)}")

    def caps(self, rows, context: float | None = None, forced=None) -> list[int | None]:
        """Per row (``budget.RowView``): the k it asked for (None: a tree's own size),
        capped at this batch size."""
        cap = self.cap(len(rows))
        return [r.requested if cap is None else (cap if r.requested is None else min(cap, r.requested)) for r in rows]

    def observe(self, step) -> None:
        """Static caps learn nothing."""

    def release(self, request_id: str) -> None:
        pass

    def cap(self, batch_size: int) -> int | None:
        """Largest k allowed at this running batch size (None = no cap)."""
        if self.disable_above_batch is not None and batch_size > self.disable_above_batch:
            return 0
        cap = None
        for min_batch, max_k in sorted(self.batch_k_caps):
            if batch_size >= min_batch:
                cap = max_k
        return cap
