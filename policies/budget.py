"""Verification budgets: each step verifies the draft slots worth what they cost.

A *slot* is one draft node of one row: position j of a chain, node j of a tree (in its
proposer's order, parents first) or of a block. Its *value* is the probability that it ends
on the accepted path — for a chain the product of the per-position acceptance rates up to
it. A step's expected tokens are one per row plus the values of the slots it verifies; its
seconds come from a cost table (what verifying each shape costs, and each drafter's forward
at each depth), profiled at start-up and refreshed while serving. The step admits the set
of slots with the highest expected tokens per second:

    rate(S) = (rows + sum of S's values) / (verify(shape(S)) + sum over methods of draft(depth))

over the candidates that can be best under the step mode's costs. Where every row is
verified as wide as the widest (padded: every step mode today), a step costs its widest row
and each method's drafting its deepest row's levels, so a row cut shorter than the other rows
of its method saves nothing: the candidates are a depth per method, every slot up to it (a free
drafter that is always right keeps its length beside a costly doubtful one trimmed). Where the
admitted slots are verified (ragged), each slot is paid for: the candidates are "the n most
valuable slots no deeper than d" for every n and d. Each row is cut to its admitted slots (its cap; 0 = plain decoding for that row): a
confident row keeps its block while a doubtful one in the same batch is trimmed, and a
drafter that is never right is cut to 0 because its slots add cost and no value.

A drafter that states its confidence in each slot (``RowView.confident``: DSpark's
confidence head) drafts its whole block once its row is admitted at all (one forward,
whatever it drafts); ``trim`` then values that row's slots by their stated confidences,
calibrated online per method against what verification accepted, and cuts it after drafting.

Exact by construction: only drafts are cut, and a cap is chosen before any token of the
step is drawn, from the request's past steps — never from a drawn token's probability.

>>> b = VerificationBudget()
>>> rows = [RowView("a", "draft")]
>>> b.costs.record(1, 1, 1.0, {}, None, profiled=True); b.costs.record(1, 9, 1.8, {}, None, profiled=True)
>>> for _ in range(50):                      # drafts never accepted
...     k = b.caps(rows)[0]
...     b.observe(StepRecord(rows, [k], [0], [[0]]))
>>> b.caps(rows)[0]
0
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from specray.policies.costs import StepCosts, monotone


@dataclass(frozen=True)
class RowView:
    """What the policy knows of a row: its request and method; ``fixed``: the request set its
    speculation size itself (``num_speculative_tokens``, a tree, a seed), which then stands
    (``requested``: that k, None for a tree's own size); ``tree``: the method drafts trees;
    ``block``: it drafts its whole length in one forward; ``confident``: its drafts carry
    per-slot acceptance estimates (``trim``)."""

    request_id: str
    method: str
    requested: int | None = None
    fixed: bool = False
    tree: bool = False
    block: bool = False
    confident: bool = False


@dataclass(frozen=True)
class StepRecord:
    """What one step did, for the policy to learn from.

    drafted:   per row, the draft nodes it verified
    accepted:  per row, the draft nodes accepted
    paths:     per row, the node indices on its accepted path (0 = the root, drafts from 1)
    parents:   per row, each draft node's parent (0 = the root; node i + 1 is draft i); None: a chain
    propose_s / verify_s: the step's seconds drafting and verifying (None: not measured)
    context:   the rows' mean tokens (prompt and output) as the step began
    """

    rows: Sequence[RowView]
    drafted: Sequence[int]
    accepted: Sequence[int]
    paths: Sequence[Sequence[int]]
    parents: Sequence[Sequence[int] | None] | None = None
    propose_s: float | None = None
    verify_s: float | None = None
    context: float | None = None


@dataclass(frozen=True)
class BudgetConfig:
    """The policy's settings (each a property of the estimates, not of a workload)."""

    max_k: int = 8
    """Most slots a self-tuned chain row drafts."""
    prior_acceptance: float = 0.6
    """Per-position acceptance assumed for a method whose weights saved none."""
    pseudo_counts: float = 4.0
    """Weight, in steps, of the method's estimate in a request's (and of the prior in the method's)."""
    forget: float = 0.98
    """Per step, the weight left on older acceptance counts: acceptance drifts along a text and
    with the traffic, and evidence against a drafter must age for it to be tried again."""
    ragged: bool = False
    """The step verifies only the admitted slots (True), or every row as wide as the widest."""
    seed: int = 0
    """Seed of the posterior draws (decisions are reproducible; outputs never depend on them)."""


@dataclass
class _Counts:
    """Per slot: how often it was reached (its parent was on the accepted path: the root for a
    chain's first position) and how often it was on the path, each count weighing ``forget``
    less per step since (whether the slot drafted then or not: a method cut to 0 drifts back
    to its prior, is admitted again, and so is measured again)."""

    reached: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    at: int = 0  # the step the counts are as of

    def add(self, reached: Sequence[int], hit: Sequence[int], forget: float, now: int) -> None:
        grow = max(reached, default=-1) + 1 - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.hits += [0.0] * grow
        age = forget ** (now - self.at)
        if age < 1.0:
            self.reached = [d * age for d in self.reached]
            self.hits = [h * age for h in self.hits]
        self.at = now
        for j in reached:
            self.reached[j] += 1.0
        for j in hit:
            self.hits[j] += 1.0

    def rate(self, j: int, prior: float, pseudo: float, age: float, rng: random.Random | None = None) -> float:
        """P(slot j on the path | its parent is): its counts weighing ``age`` (forget ** steps
        since ``at``), shrunk towards ``prior`` — the posterior mean, or with ``rng`` a draw
        from the posterior, Beta(hits + pseudo * prior, misses + pseudo * (1 - prior)), taken
        as the normal of its mean and variance, clipped to [0, 1]."""
        hits, reached = (age * self.hits[j], age * self.reached[j]) if j < len(self.reached) else (0.0, 0.0)
        a, b = hits + pseudo * prior, reached - hits + pseudo * (1.0 - prior)
        if a + b <= 0:  # no counts and no weight on the prior
            return prior
        if rng is None or a <= 0 or b <= 0:
            return a / (a + b)
        n = a + b  # a normal of the Beta's moments: a tenth of a Beta draw's cost, on every slot of every row
        return min(max(rng.gauss(a / n, math.sqrt(a * b / (n * n * (n + 1)))), 0.0), 1.0)

    def seen(self, j: int) -> bool:
        return j < len(self.reached) and self.reached[j] > 0


CONFIDENCE_BINS = 10
"""Bins of a drafter's stated confidence, each calibrated against measured acceptance."""


class _Calibration:
    """Per method: what its drafts' stated confidences turned out to be worth. Per bin of
    confidence, the slots reached and on the path (``_Counts`` over bins); a slot's rate is
    its bin's acceptance shrunk towards the stated confidence itself, so an uncalibrated head
    is trusted at first and corrected as its slots are verified."""

    def __init__(self):
        self.counts = _Counts()

    @staticmethod
    def bin(confidence: float) -> int:
        return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)

    def add(self, confidences: Sequence[float], reached: Sequence[int], hit: Sequence[int], forget: float,
            now: int) -> None:
        bins = lambda slots: [self.bin(confidences[j]) for j in slots if j < len(confidences)]  # noqa: E731
        self.counts.add(bins(reached), bins(hit), forget, now)

    def rate(self, confidence: float, pseudo: float, age: float) -> float:
        """P(slot on the path | its parent is), given the drafter's confidence in it."""
        c = min(max(float(confidence), 0.0), 1.0)
        return self.counts.rate(self.bin(c), c, pseudo, age)


def _reached(parents: Sequence[int], counted: int, path: Sequence[int]) -> tuple[list[int], list[int]]:
    """Slots (0-based: node j + 1) reached (their parent on the path) and on the path."""
    on = set(path)
    reached = [j for j in range(counted) if (parents[j] if j < len(parents) else j) in on]
    return reached, [j for j in reached if j + 1 in on]


@dataclass(frozen=True)
class Admission:
    """A step's decision: per row its cap, and what the policy expected of it."""

    caps: list[int | None]
    slots: int
    tokens: float
    seconds: float


class VerificationBudget:
    """The speculation-length policy (module doc): ``caps`` before a step, ``observe`` after."""

    def __init__(self, config: BudgetConfig | None = None, priors: Mapping[str, Sequence[float]] | None = None,
                 costs: StepCosts | None = None):
        self.config = config or BudgetConfig()
        # method -> acceptance per position measured when its weights were trained (P(position
        # j accepted | j - 1 accepted)): where its estimates start.
        self.priors = {m: [float(r) for r in rates] for m, rates in (priors or {}).items() if rates}
        self.costs = costs or StepCosts(ragged=self.config.ragged)
        self._methods: defaultdict[str, _Counts] = defaultdict(_Counts)
        self._requests: defaultdict[str, dict[str, _Counts]] = defaultdict(dict)  # method -> request -> counts
        self._shapes: dict[str, tuple[int, ...]] = {}  # tree method -> its nodes' parents, as last drafted whole
        self._caps: dict[str, int | None] = {}  # request -> the cap it was given this step
        self.last: Admission | None = None
        self.totals = {"steps": 0, "rows": 0, "slots": 0}  # steps decided, their rows and admitted slots
        self._step = 0
        self._rng = random.Random(self.config.seed)  # the posterior draws (never a request's generator)
        self._draws: dict = {}  # (method, slot, prior) -> this step's draw
        self._spreads: dict[str, float] = {}  # method -> this step's request-level pseudo-counts
        self._context: float | None = None  # this step's mean tokens a row
        self._forced: list[int] | None = None  # this step's forced tokens per row
        self._calibrations: defaultdict[str, _Calibration] = defaultdict(_Calibration)
        self._stated: dict[str, list[float]] = {}  # request -> its draft's confidences this step

    def fresh(self) -> "VerificationBudget":
        """A policy with these settings, priors and costs that has learned no acceptance yet."""
        return VerificationBudget(self.config, self.priors, self.costs)

    # -- estimates -----------------------------------------------------------------------------
    def values(self, row: RowView, slots: int, draw: bool = False) -> list[float]:
        """P(slot j on the accepted path) for the row's first ``slots`` slots: the product of the
        conditional rates along its ancestors, each the request's own counts shrunk towards
        its method's, shrunk towards the prior. ``draw``: the method's rates drawn from their
        posteriors (one draw per method and slot per step) instead of their means — Thompson
        sampling, so that a drafter whose estimate is uncertain is tried in proportion to the
        chance that it pays, and one whose estimate is sure is not."""
        pseudo, forget = self.config.pseudo_counts, self.config.forget
        method, own = self._methods.get(row.method), self._requests[row.method].get(row.request_id)
        m_age = forget ** (self._step - method.at) if method is not None else 1.0
        r_age = forget ** (self._step - own.at) if own is not None else 1.0
        parents = self._parents(row, slots)
        saved = self.priors.get(row.method)
        siblings = defaultdict(int)
        for p in parents:
            siblings[p] += 1
        out, rates, depths = [], [], []
        for j, p in enumerate(parents):
            depth = depths[p - 1] + 1 if p > 0 else 1
            depths.append(depth)
            if saved:  # the rate measured at training at this depth (beyond: the last one)
                prior = saved[min(depth - 1, len(saved) - 1)]
            elif row.tree or j == 0 or not (method is not None and method.seen(j - 1)):
                prior = self.config.prior_acceptance
            else:  # a chain position never reached yet: as the one before it
                prior = rates[j - 1]
            prior /= siblings[p]  # a node shares its parent's continuation with its siblings
            if draw:
                key = (row.method, j, prior)
                if key not in self._draws:
                    counts = method if method is not None else _Counts()
                    self._draws[key] = counts.rate(j, prior, pseudo, m_age, self._rng)
                rate = self._draws[key]
            else:
                rate = method.rate(j, prior, pseudo, m_age) if method is not None else prior
            rate = own.rate(j, rate, self._spread(row.method), r_age, self._rng if draw else None) if own is not None else rate
            rates.append(rate)
            out.append(rate * (out[p - 1] if p > 0 else 1.0))
        return out

    def stated_values(self, row: RowView, confidences: Sequence[float]) -> list[float]:
        """P(slot j on the accepted path) for a chain whose drafter stated these per-slot
        confidences: the product of their calibrated rates."""
        calibration = self._calibrations[row.method]
        age = self.config.forget ** (self._step - calibration.counts.at)
        out, value = [], 1.0
        for c in confidences:
            value *= calibration.rate(c, self.config.pseudo_counts, age)
            out.append(value)
        return out

    def _spread(self, method: str) -> float:
        """Pseudo-counts of the method's estimate in each request's: ``pseudo_counts`` where its
        requests accept alike, fewer the more they differ — method of moments on the requests'
        first-slot rates (their spread less what their own counts' noise explains), so that in
        a batch of easy and hard texts each request soon stands on its own evidence."""
        if method in self._spreads:
            return self._spreads[method]
        cap = self.config.pseudo_counts
        rates = [(c.hits[0] / c.reached[0], c.reached[0]) for c in self._requests[method].values()
                 if c.reached and c.reached[0] >= 1]
        pseudo = cap
        if len(rates) >= 2:
            mean = sum(r for r, _ in rates) / len(rates)
            spread = sum((r - mean) ** 2 for r, _ in rates) / (len(rates) - 1)
            noise = sum(mean * (1 - mean) / n for _, n in rates) / len(rates)
            if spread > noise and 0 < mean < 1:
                pseudo = min(cap, max(mean * (1 - mean) / (spread - noise) - 1, 0.0))
        self._spreads[method] = pseudo
        return pseudo

    def _parents(self, row: RowView, slots: int) -> list[int]:
        """Each slot's parent (0 = the root): a tree's shape as last drafted whole, else a chain."""
        shape = self._shapes.get(row.method) if row.tree else None
        parents = list(shape[:slots]) if shape else []
        return parents + list(range(len(parents), slots))

    # -- deciding ------------------------------------------------------------------------------
    def caps(self, rows: Sequence[RowView], context: float | None = None,
             forced: Sequence[int] | None = None) -> list[int | None]:
        """Per row: the most draft nodes it may take this step (None: its tree's own size),
        priced at ``context`` tokens a row (their mean). ``forced``: per row, the tokens its
        grammar forces this step, verified whatever the caps (each the only token the masked
        target allows: worth 1); they widen the step, so other rows' slots up to that width
        cost no further verification where rows are padded.
        A ``confident`` row admitted at all drafts its whole length (one forward whatever
        it drafts); ``trim`` cuts it once its confidences are known."""
        self._step += 1
        self._draws.clear()
        self._spreads.clear()
        self._stated.clear()
        self._context = context
        self._forced = list(forced) if forced is not None and any(forced) else None
        admission = self.admit(rows)
        self.last = admission
        caps = [self._slots(r) if r.confident and not r.fixed and c else c for r, c in zip(rows, admission.caps)]
        self._caps = {r.request_id: c for r, c in zip(rows, caps)}
        self.totals["steps"] += 1
        self.totals["rows"] += len(rows)
        self.totals["slots"] += admission.slots
        return caps

    def trim(self, rows: Sequence[RowView], drafted: Sequence[int],
             confidences: Sequence[Sequence[float] | None]) -> list[int]:
        """After drafting: per row, the slots it verifies. A row's slots are valued by its
        draft's ``confidences`` (per slot, P(accepted | its parent is) as the drafter states
        it, calibrated online per method) where it has them, else as ``caps`` valued them;
        no row verifies more than it ``drafted``. Only what is known before a slot's token
        is drawn may enter its confidence (the module doc's exactness)."""
        admission = self.admit(rows, confidences, drafted)
        self.totals["slots"] += admission.slots - self.last.slots if self.last is not None else 0
        self.last = admission
        out = []
        for r, d, c, cap in zip(rows, drafted, confidences, admission.caps):
            n = d if cap is None else min(d, cap)
            if c and not r.fixed:
                self._stated[r.request_id] = [float(x) for x in c[:n]]
                self._caps[r.request_id] = n
            out.append(n)
        return out

    def admit(self, rows: Sequence[RowView], confidences: Sequence[Sequence[float] | None] | None = None,
              drafted: Sequence[int] | None = None) -> Admission:
        """The best of the candidates (module doc), each priced as its step would run;
        ``confidences``/``drafted`` as ``trim`` takes them."""
        sizes = [self._slots(r) for r in rows]
        if drafted is not None:
            sizes = [min(n, d) for n, d in zip(sizes, drafted)]
        fixed = [r.fixed or r.method == "none" for r in rows]
        counts = [n if f and r.method != "none" else 0 for r, f, n in zip(rows, fixed, sizes)]
        if all(fixed):  # nothing to decide
            return Admission([r.requested for r in rows], sum(counts), float("nan"), float("nan"))
        stated = confidences or [None] * len(rows)
        # a row is cut to a prefix: a later slot worth more than an earlier one comes with it
        free = [[] if f else monotone(self.stated_values(r, c[:n]) if c else self.values(r, n, draw=True), increasing=False)
                for r, f, n, c in zip(rows, fixed, sizes, stated)]
        given = len(rows) + sum(sum(self.values(r, c)) for r, c in zip(rows, counts) if c)  # fixed rows' tokens
        if self._forced is not None and len(self._forced) == len(rows):  # verified anyway, each worth 1
            given += sum(self._forced)
        prices: tuple[dict, dict] = ({}, {})  # this step's verify and draft costs, read once per shape
        step = _Step(self, rows, counts, given, prices)
        best = (list(counts), *step.price())
        deepest = max(map(len, free), default=0)
        if self.costs.ragged:  # every slot priced: the most valuable ones no deeper than each depth
            order = sorted(((v, i, j) for i, vs in enumerate(free) for j, v in enumerate(vs)), key=lambda t: (-t[0], t[2]))
            for depth in range(1, deepest + 1):
                step = _Step(self, rows, counts, given, prices)
                for _, i, j in order:
                    if j < depth:
                        step.grow(i, j + 1, free[i])
                        best = _better(best, step)
        else:
            best = self._padded(rows, free, counts, given, prices, best)
        counts, tokens, seconds = best
        caps = [r.requested if f else (None if r.tree and c >= n else c)
                for r, f, c, n in zip(rows, fixed, counts, sizes)]
        return Admission(caps, sum(counts), tokens, seconds)

    def _padded(self, rows, free, counts, given: float, prices: tuple[dict, dict], best: tuple) -> tuple:
        """Padded steps: a step verifies every row as wide as the widest, and a method drafts as
        deep as its deepest row, so a row cut shorter than its method's others saves nothing:
        the candidates are a depth per method (every slot up to it, for each of its rows). For
        each widest depth D the best depths no deeper than D are found exactly by Dinkelbach's
        method: the rate (given + sum of gains) / (verify(D) + sum of drafting) is best where,
        at that rate r, every method's depth maximises its own gain - r * drafting."""
        base = _Step(self, rows, counts, given, prices)  # the fixed rows alone
        methods = sorted({rows[i].method for i, vs in enumerate(free) if vs})
        members = {m: [i for i, vs in enumerate(free) if vs and rows[i].method == m] for m in methods}
        deepest = {m: max(len(free[i]) for i in idx) for m, idx in members.items()}
        gain, cost = {}, {}
        for m, idx in members.items():  # per depth d: the method's expected tokens and drafting seconds
            gain[m] = [sum(sum(free[i][:d]) for i in idx) for d in range(deepest[m] + 1)]
            cost[m] = [self._draft_price(m, base.drafting.get(m, 0) + (len(idx) if d else 0), max(
                base.levels.get(m, 0), max((1 if rows[i].block else self._depth(rows[i], min(d, len(free[i])))
                                            for i in idx), default=0) if d else 0), prices)
                       for d in range(deepest[m] + 1)]
        fixed_only = sum(self._draft_price(m, base.drafting[m], lv, prices) for m, lv in base.levels.items()
                         if m not in gain)
        if best[2] <= 0:  # a step measured as free (a clock's resolution): nothing can beat it
            return best
        rate = best[1] / best[2]
        for depth in range(1, max(deepest.values(), default=0) + 1):
            widest = max(base.widest, 1 + depth)
            if widest not in prices[0]:
                prices[0][widest] = self.costs.verify(len(rows), widest, self._context)
            verify = prices[0][widest] + fixed_only
            while True:  # Dinkelbach: the depths best at the best rate so far; stop when none is better
                if len(methods) == 1:  # one method: shallower than the widest is dominated
                    depths = {methods[0]: min(depth, deepest[methods[0]])}
                else:
                    depths = {m: max(range(min(depth, deepest[m]) + 1), key=lambda d, m=m: gain[m][d] - rate * cost[m][d])
                              for m in methods}
                tokens = given + sum(gain[m][d] for m, d in depths.items())
                seconds = verify + sum(cost[m][d] for m, d in depths.items())
                if tokens * best[2] <= best[1] * seconds:
                    break
                caps = list(counts)
                for m, idx in members.items():
                    for i in idx:
                        caps[i] = min(depths[m], len(free[i]))
                best, rate = (caps, tokens, seconds), tokens / seconds
        return best

    def _draft_price(self, method: str, rows: int, levels: int, prices: tuple[dict, dict]) -> float:
        if not rows or not levels:
            return 0.0
        key = (method, rows, levels)
        if key not in prices[1]:
            prices[1][key] = self.costs.draft(*key, self._context)
        return prices[1][key]

    def _slots(self, row: RowView) -> int:
        """Most slots the row may draft: its request's k, its tree's size, or ``max_k``."""
        if row.method == "none":
            return 0
        if row.requested is not None and row.fixed:
            return row.requested
        if row.tree:
            return len(self._shapes.get(row.method, ())) or self.config.max_k
        return max(self.config.max_k, row.requested or 0)

    @staticmethod
    def _depth(row: RowView, slots: int) -> int:
        """The drafting work a cap of ``slots`` asks for, as the cost table keys it: the cap
        itself — a chain's levels; a tree's room, which sets how deep and how wide it grows
        (an EAGLE-2 tree capped at k grows min(depth, k) levels of min(top_k, k) nodes, however
        shallow the nodes it keeps) — or one forward for a block drafter."""
        return 1 if row.block else slots

    # -- learning ------------------------------------------------------------------------------
    def observe(self, step: StepRecord) -> None:
        """Learn from a step: each row's slots reached and on its accepted path, and its costs."""
        forget = self.config.forget
        for r, d, path, parents in zip(step.rows, step.drafted, step.paths, step.parents or [None] * len(step.rows)):
            if r.method == "none":
                continue
            cap = self._caps.get(r.request_id)
            if r.tree and parents and len(parents) >= len(self._shapes.get(r.method, ())):
                self._shapes[r.method] = tuple(parents)  # its largest tree, as drafted
            # A chain's slots admitted but not drafted (a drafter with nothing to propose)
            # count: the slot after its last drafted one was reached, and missed.
            counted = d if parents else max(d, cap or 0)
            if counted:
                reached, hit = _reached(parents or [], counted, path)
                self._methods[r.method].add(reached, hit, forget, self._step)
                self._requests[r.method].setdefault(r.request_id, _Counts()).add(reached, hit, forget, self._step)
                stated = self._stated.pop(r.request_id, None)
                if stated:
                    self._calibrations[r.method].add(stated, reached, hit, forget, self._step)
        self.observe_costs(step)

    def observe_costs(self, step: StepRecord, profiled: bool = False) -> None:
        """Record what the step's shapes cost (its acceptance aside); ``profiled``: a step of the
        start-up profile (it shapes the cost curves; served steps set their level)."""
        widths = [1 + d for d in step.drafted]
        drafting: dict[str, tuple[int, int]] = {}
        for r, d in zip(step.rows, step.drafted):
            if r.method != "none" and d:
                cap = None if profiled else self._caps.get(r.request_id)  # (the profile's rows draft their cap)
                depth = self._depth(r, max(d, cap or 0))
                rows, deepest = drafting.get(r.method, (0, 0))
                drafting[r.method] = (rows + 1, max(deepest, depth))
        self.costs.record(len(step.rows), sum(widths) if self.costs.ragged else max(widths), step.verify_s,
                          drafting, step.propose_s, profiled, step.context)

    def release(self, request_id: str) -> None:
        for requests in self._requests.values():
            requests.pop(request_id, None)
        self._caps.pop(request_id, None)
        self._stated.pop(request_id, None)

    def start_method(self, method: str, rates: Sequence[float]) -> None:
        """A new drafter version serves ``method`` (online learning): forget what its old
        version accepted and start from ``rates`` (per position, as its gate measured them)."""
        self.priors[method] = [min(max(float(r), 0.0), 1.0) for r in rates]
        self._methods.pop(method, None)
        self._calibrations.pop(method, None)

    def status(self) -> dict:
        """The cost table, the confidence calibrations, the last decision and the totals
        (steps decided, their rows, the slots admitted)."""
        last = self.last
        calibration = {m: [(round((b + 0.5) / CONFIDENCE_BINS, 2), round(c.hits[b] / c.reached[b], 3), round(c.reached[b], 1))
                           for b in range(len(c.reached)) if c.reached[b] >= 1]
                       for m, c in ((m, cal.counts) for m, cal in self._calibrations.items())}
        return {"costs": self.costs.table(), "calibration": calibration, "totals": dict(self.totals),
                "last": None if last is None else {"caps": last.caps, "slots": last.slots,  # (NaN: all fixed)
                                                   "expected_tokens": None if last.tokens != last.tokens else round(last.tokens, 3),
                                                   "predicted_s": None if last.seconds != last.seconds else last.seconds}}


def _better(best: tuple, step: "_Step") -> tuple:
    """``best`` or the step, whichever has more expected tokens per second."""
    tokens, seconds = step.price()
    return (list(step.counts), tokens, seconds) if tokens * best[2] > best[1] * seconds else best


class _Step:
    """A candidate step, grown slot by slot: its expected tokens and predicted seconds kept
    current in O(methods) per slot."""

    def __init__(self, policy: VerificationBudget, rows: Sequence[RowView], counts: Sequence[int], tokens: float,
                 prices: tuple[dict, dict]):
        self.policy, self.rows, self.counts, self.tokens = policy, rows, list(counts), tokens
        self.verify_s, self.draft_s = prices  # shape -> seconds, filled as candidates read them
        widths = [1 + c for c in counts]
        floors = policy._forced if policy._forced is not None and len(policy._forced) == len(rows) else None
        self.floors = floors or [0] * len(rows)  # rows verifying their forced tokens are at least that wide
        widths = [max(w, 1 + f) for w, f in zip(widths, self.floors)]
        self.total, self.widest = sum(widths), max(widths)
        self.levels: dict[str, int] = {}
        self.drafting: dict[str, int] = defaultdict(int)
        for r, c in zip(rows, counts):
            if c:
                self.drafting[r.method] += 1
                self._draft(r, c)

    def _draft(self, row: RowView, count: int) -> None:
        depth = 1 if row.block else self.policy._depth(row, count)
        self.levels[row.method] = max(self.levels.get(row.method, 0), depth)

    def grow(self, i: int, count: int, values: Sequence[float]) -> None:
        """Row i now verifies its first ``count`` free slots."""
        old = self.counts[i]
        if count <= old:
            return
        if not old:
            self.drafting[self.rows[i].method] += 1
        self.tokens += sum(values[old:count])
        self.counts[i] = count
        self.total += max(count, self.floors[i]) - max(old, self.floors[i])
        self.widest = max(self.widest, 1 + count)
        self._draft(self.rows[i], count)

    def price(self) -> tuple[float, float]:
        """(expected tokens, predicted seconds)."""
        costs = self.policy.costs
        size = self.total if costs.ragged else self.widest
        seconds = self.verify_s.get(size)
        if seconds is None:
            seconds = self.verify_s[size] = costs.verify(len(self.rows), size, self.policy._context)
        for m, lv in self.levels.items():
            key = (m, self.drafting[m], lv)
            drafting = self.draft_s.get(key)
            if drafting is None:
                drafting = self.draft_s[key] = costs.draft(*key, self.policy._context)
            seconds += drafting
        return self.tokens, seconds


__all__ = ["Admission", "BudgetConfig", "RowView", "StepRecord", "VerificationBudget"]
