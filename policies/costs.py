"""What a speculative step costs, per shape: the verification budget's cost table.

Two kinds of curves, each built of medians of recent measurements (so a collector pause or a
neighbour's burst moves them only when it lasts):

* ``verify``: (batch-size bucket, size) -> seconds of the target's forward and acceptance,
  where size is what the step mode runs: the verified tokens of all rows together (ragged) or
  the widest row's tokens (padded: every row is verified that wide);
* ``draft``: (method, batch-size bucket, levels) -> seconds of its drafting; ``levels`` is the
  work its rows' caps ask for: the most slots a row was given (a chain's sequential forwards; a
  tree's room, which sets how deep and wide it grows), 1 for a block drafter's single forward.

Each curve is kept at every context length the profile ran (tokens per row): attention and the
KV cache grow with the context while the rest of a forward grows with the tokens verified, so
the *shape* along size changes with it (on the demo pair at batch 32, verifying 5 tokens a row
costs 3x one at 24 tokens of context, 1.8x at 200). A step is priced at its rows' mean context,
linearly between the two nearest profiled ones (beyond them, along the nearest two).

The engine profiles the curves at start-up: they give the shape of the costs. What serving
measures sets their *level*: the median, over recent served steps, of a step's seconds over
what the profiled curves predict for it. Longer contexts, a busier machine or warm caches move
every shape alike, so one level rescales the whole table — no entry goes stale beside a
refreshed one, and a drafter switched off is priced at today's level, not at its last step's.
A curve the profile did not measure (a method it skipped) is built from served steps, each
size's own median, and no level. A size never measured is interpolated along size (levels) between the measured ones of its
bucket, extrapolated from the nearest two beyond them (never falling); with a single
measurement it is taken as flat — the optimistic reading, so that a step measures the shape
instead of never trying it. A bucket never measured reads its nearest.

>>> c = StepCosts(ragged=True)
>>> c.record(1, 1, 1.0, {}, None, profiled=True); c.record(1, 5, 2.0, {}, None, profiled=True)
>>> c.verify(1, 3), c.verify(1, 9)
(1.5, 3.0)
>>> c.record(1, 1, 2.0, {}, None)       # served steps cost twice the profile: every size does
>>> c.verify(1, 3), c.verify(1, 9)
(3.0, 6.0)
>>> c = StepCosts(ragged=True)
>>> c.record(1, 1, 1.0, {}, None, profiled=True, context=100); c.record(1, 1, 3.0, {}, None, profiled=True, context=300)
>>> c.verify(1, 1, context=200), c.verify(1, 1, context=500)
(2.0, 5.0)
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from typing import Sequence


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


def monotone(values: Sequence[float], weights: Sequence[float] | None = None, increasing: bool = True) -> list[float]:
    """The closest monotone sequence to ``values`` in weighted least squares (pool adjacent
    violators): a cost that falls as its shape grows is noise, as is a draft value that rises
    along a row.

    >>> monotone([1.0, 3.0, 2.0]), monotone([0.5, 0.1, 0.3], increasing=False)
    ([1.0, 2.5, 2.5], [0.5, 0.2, 0.2])
    """
    sign = 1.0 if increasing else -1.0
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([sign * v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += n
    return [sign * total / weight for total, weight, n in blocks for _ in range(n)]


def bucket(batch: int) -> int:
    """The batch-size bucket a running batch falls in: 1, 2, 4, 8, ..."""
    return 1 << max(batch - 1, 0).bit_length()


class _Curve:
    """One bucket's costs along size: the median of each size's recent measurements."""

    def __init__(self, window: int, profiled: bool):
        self.window, self.profiled = window, profiled
        self.samples: dict[int, deque] = {}
        self._medians: dict[int, float] | None = None
        self._at: dict[int, float] = {}  # predictions since the last measurement

    def add(self, size: int, seconds: float) -> None:
        self.samples.setdefault(size, deque(maxlen=self.window)).append(seconds)
        self._medians = None
        self._at.clear()

    def medians(self) -> dict[int, float]:
        """Each size's median, made non-decreasing along size (weighted by its samples)."""
        if self._medians is None:
            sizes = sorted(self.samples)
            fitted = monotone([statistics.median(self.samples[s]) for s in sizes], [len(self.samples[s]) for s in sizes])
            self._medians = dict(zip(sizes, fitted))
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


class _Surface:
    """One bucket's curves, one per profiled context length (module doc); curves built from
    served steps have none (their steps' contexts vary: key 0)."""

    def __init__(self, window: int, profiled: bool):
        self.window, self.profiled = window, profiled
        self.curves: dict[int, _Curve] = {}

    def curve(self, context: int) -> _Curve:
        key = context if self.profiled else 0
        if key not in self.curves:
            self.curves[key] = _Curve(self.window, self.profiled)
            self.contexts = sorted(self.curves)
        return self.curves[key]

    contexts: list[int] = []  # the curves' contexts, ascending (each curve has samples once made)

    def at(self, size: int, context: float | None) -> float:
        contexts = self.contexts
        if not contexts:
            return 0.0
        if context is None or len(contexts) == 1:
            return self.curves[contexts[0]].at(size)
        i = min(max(bisect.bisect_right(contexts, context), 1), len(contexts) - 1)  # the pair around it, or nearest
        a, b = contexts[i - 1], contexts[i]
        ya, yb = self.curves[a].at(size), self.curves[b].at(size)
        return max(ya + max((yb - ya) / (b - a), 0.0) * (context - a), 0.0)


class StepCosts:
    """The cost table (module doc)."""

    def __init__(self, ragged: bool = False, window: int = 16):
        self.ragged, self.window = ragged, window
        self._verify: dict[int, _Curve] = {}
        self._draft: dict[str, dict[int, _Curve]] = {}  # method -> bucket -> curve
        self._levels: deque = deque(maxlen=window)  # served steps' seconds / the profile's prediction
        self.level = 1.0

    def record(self, batch: int, size: int, verify_s: float | None, drafting: dict[str, tuple[int, int]],
               propose_s: float | None, profiled: bool = False, context: float | None = None) -> None:
        """A step of ``batch`` rows verifying ``size`` (module doc) in ``verify_s`` seconds, and
        drafting ``drafting`` (method -> (its rows, levels)) in ``propose_s``; ``profiled``: a
        step of the start-up profile; ``context``: its rows' mean tokens (the profile's own
        context length when ``profiled``)."""
        ctx = int(context or 0)
        if not profiled:
            verify = self._verify.get(bucket(batch))
            drafts = [(self._draft.get(m, {}).get(bucket(b)), lv) for m, (b, lv) in drafting.items()]
            if verify is not None and verify.profiled and all(c is not None and c.profiled for c, _ in drafts):
                predicted = verify.at(size, context) + sum(c.at(lv, context) for c, lv in drafts)
                if predicted > 0 and verify_s is not None and (propose_s is not None or not drafts):
                    self._levels.append((verify_s + (propose_s or 0.0)) / predicted)
                    self.level = statistics.median(self._levels)
                return
        if verify_s is not None:
            surface = self._surface(self._verify, bucket(batch), profiled)
            if surface.profiled == profiled:
                surface.curve(ctx).add(size, verify_s)
        if propose_s is not None and drafting:
            # the drafting seconds shared out as the curves predict them (evenly where they cannot)
            surfaces = {m: (self._surface(self._draft.setdefault(m, {}), bucket(b), profiled), lv)
                        for m, (b, lv) in drafting.items()}
            predicted = {m: c.at(lv, context) for m, (c, lv) in surfaces.items()}
            total = sum(predicted.values())
            for m, (c, lv) in surfaces.items():
                if c.profiled == profiled:
                    c.curve(ctx).add(lv, propose_s * (predicted[m] / total if total > 0 else 1.0 / len(surfaces)))

    def _surface(self, surfaces: dict[int, _Surface], key: int, profiled: bool) -> _Surface:
        """The bucket's surface; a profile's measurement replaces one built from served steps."""
        surface = surfaces.get(key)
        if surface is None or (profiled and not surface.profiled):
            surface = surfaces[key] = _Surface(self.window, profiled)
        return surface

    def verify(self, batch: int, size: int, context: float | None = None) -> float:
        """Seconds to verify ``size`` (module doc) in a batch of ``batch`` rows of ``context``
        tokens each on average (None: the shortest profiled); 1.0 per step of unit cost when
        nothing was measured (only ratios matter then)."""
        surface = _nearest(self._verify, bucket(batch))
        return self._scaled(surface, size, context) if surface is not None else 1.0

    def draft(self, method: str, batch: int, levels: int, context: float | None = None) -> float:
        """Seconds ``method`` drafts ``levels`` deep for ``batch`` rows (0 until measured)."""
        surface = _nearest(self._draft.get(method, {}), bucket(batch))
        return self._scaled(surface, levels, context) if surface is not None else 0.0

    def _scaled(self, surface: _Surface, size: int, context: float | None) -> float:
        return surface.at(size, context) * (self.level if surface.profiled else 1.0)

    def table(self) -> dict:
        """Every measured entry, at today's level: {"verify": {"8x5@24": s}, "draft":
        {"eagle@8x3@24": s}, "level": x} (@ the profiled context; served curves have none)."""
        def entries(name: str, surface: _Surface) -> dict:
            return {f"{name}x{s}" + (f"@{ctx}" if surface.profiled else ""): c.at(s) * (self.level if surface.profiled else 1.0)
                    for ctx, c in sorted(surface.curves.items()) for s in c.medians()}

        out: dict = {"verify": {}, "draft": {}, "level": self.level}
        for b, surface in sorted(self._verify.items()):
            out["verify"].update(entries(str(b), surface))
        for m, surfaces in sorted(self._draft.items()):
            for b, surface in sorted(surfaces.items()):
                out["draft"].update(entries(f"{m}@{b}", surface))
        return out


def _nearest(curves: dict, key: int):
    if key in curves:
        return curves[key]
    if not curves:
        return None
    return curves[min(curves, key=lambda b: (abs(b.bit_length() - key.bit_length()), b))]
