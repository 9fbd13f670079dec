"""What a speculative step costs, per shape: the verification budget's cost table.

Two kinds of entries, each the median of its recent measurements (so a collector pause or a
neighbour's burst moves it only when it lasts):

* ``verify``: (batch-size bucket, size) -> seconds of the target's forward and acceptance,
  where size is what the step mode runs: the verified tokens of all rows together (ragged) or
  the widest row's tokens (padded: every row is verified that wide);
* ``draft``: (method, batch-size bucket, levels) -> seconds of its drafting; ``levels`` is the
  depth it drafts to (sequential forwards), 1 for a block drafter's single forward.

Entries are measured at start-up (the engine profiles its shapes) and refreshed by every step
that runs them. A shape never measured is interpolated along size (levels) between the
measured ones of its bucket, extrapolated from the nearest two beyond them (never falling);
with a single measurement it is taken as flat — the optimistic reading, so that a step
measures the shape instead of never trying it. A bucket never measured reads its nearest.

>>> c = StepCosts(ragged=True)
>>> c.record_verify(1, 1, 1.0); c.record_verify(1, 5, 2.0)
>>> c.verify(1, 3), c.verify(1, 9)
(1.5, 3.0)
"""

from __future__ import annotations

import statistics
from collections import deque


def profile_widths(max_k: int) -> list[int]:
    """Draft lengths a start-up profile runs at each batch-size bucket: 0, then doubling to
    ``max_k`` — dense where costs bend (a GPU's flat part ends), sparse where they are straight.

    >>> profile_widths(8)
    [0, 1, 2, 4, 8]
    """
    out = [0]
    while out[-1] < max_k:
        out.append(min(max(1, 2 * out[-1]), max_k))
    return out


def bucket(batch: int) -> int:
    """The batch-size bucket a running batch falls in: 1, 2, 4, 8, ..."""
    return 1 << max(batch - 1, 0).bit_length()


class _Curve:
    """Measurements of one bucket along size: the median of each size's recent ones."""

    def __init__(self, window: int):
        self.window = window
        self.samples: dict[int, deque] = {}
        self._medians: dict[int, float] | None = None
        self._at: dict[int, float] = {}  # predictions since the last measurement

    def add(self, size: int, seconds: float) -> None:
        self.samples.setdefault(size, deque(maxlen=self.window)).append(seconds)
        self._medians = None
        self._at.clear()

    def medians(self) -> dict[int, float]:
        if self._medians is None:
            self._medians = {s: statistics.median(v) for s, v in sorted(self.samples.items())}
        return self._medians

    def at(self, size: int) -> float:
        if size not in self._at:
            self._at[size] = self._predict(size)
        return self._at[size]

    def _predict(self, size: int) -> float:
        known = self.medians()
        if size in known:
            return known[size]
        sizes = list(known)
        if len(sizes) == 1:
            return known[sizes[0]]
        below = [s for s in sizes if s < size]
        above = [s for s in sizes if s > size]
        if below and above:
            a, b = below[-1], above[0]
        elif below:
            a, b = below[-2], below[-1]
        else:
            a, b = above[0], above[1]
        slope = max((known[b] - known[a]) / (b - a), 0.0)
        return max(known[a] + slope * (size - a), 0.0)


class StepCosts:
    """The cost table (module doc)."""

    def __init__(self, ragged: bool = False, window: int = 16):
        self.ragged, self.window = ragged, window
        self._verify: dict[int, _Curve] = {}
        self._draft: dict[str, dict[int, _Curve]] = {}  # method -> bucket -> curve

    def record_verify(self, batch: int, size: int, seconds: float) -> None:
        self._verify.setdefault(bucket(batch), _Curve(self.window)).add(size, seconds)

    def record_draft(self, method: str, batch: int, levels: int, seconds: float) -> None:
        self._draft.setdefault(method, {}).setdefault(bucket(batch), _Curve(self.window)).add(levels, seconds)

    def verify(self, batch: int, size: int) -> float:
        """Seconds to verify ``size`` (module doc) in a batch of ``batch`` rows; 1.0 per step of
        unit cost when nothing was measured (only ratios matter then)."""
        curve = _nearest(self._verify, bucket(batch))
        return curve.at(size) if curve is not None else 1.0

    def draft(self, method: str, batch: int, levels: int) -> float:
        """Seconds ``method`` drafts ``levels`` deep for ``batch`` rows (0 until measured)."""
        curve = _nearest(self._draft.get(method, {}), bucket(batch))
        return curve.at(levels) if curve is not None else 0.0

    def table(self) -> dict:
        """Every measured entry's median: {"verify": {"8x5": s}, "draft": {"eagle@8x3": s}}."""
        return {"verify": {f"{b}x{s}": m for b, c in sorted(self._verify.items()) for s, m in c.medians().items()},
                "draft": {f"{m}@{b}x{lv}": s for m, curves in sorted(self._draft.items())
                          for b, c in sorted(curves.items()) for lv, s in c.medians().items()}}


def _nearest(curves: dict, key: int):
    if key in curves:
        return curves[key]
    if not curves:
        return None
    return curves[min(curves, key=lambda b: (abs(b.bit_length() - key.bit_length()), b))]
