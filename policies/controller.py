"""Self-tuning speculation length: each step, the k per method that maximises expected tokens
per second, learned online — k = 0 (plain decoding) when speculation does not pay.

vLLM and TensorRT-LLM use a static k or a batch-size table; here both sides of the trade are
measured while serving:

* **acceptance**, per request and per draft position: a_j = P(position j accepted | j - 1
  accepted), counted from every step and shrunk towards the method's own estimate (which
  starts from a prior), so a new request starts from what the method usually achieves;
  expected tokens of a row drafting k: E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j;
* **cost**, per batch-size bucket: step seconds = t0 + sum_m t_m * k_m (k_m: the most draft
  nodes any row of method m took this step) + sum_b f_b * [k_b > 0] for methods that draft a
  whole block in one forward (PARD, DFlash: ``MethodSpec.block``; their drafting costs one
  forward whatever k, so t_b is what verifying one more token costs), fitted by exponentially
  forgotten ridge least
  squares around a prior, from the time of every step (wall time; the engine's CPU time on a
  CPU with every proposer in its process, which other work on the same cores does not
  inflate).

Where it starts: the acceptance measured when the method's weights were trained (``priors``:
the weights' ``specray_acceptance``, per position and, for a tree, as deep as its tree), else
``prior_acceptance`` at every position; the cost of a step from its first measurements. Before
it decides anything in a batch-size bucket it explores briefly: each method drafts its first
``MIN_TRIES`` steps there, and the bucket's second step is a plain probe (``PROBE_EVERY``), so
one unlucky first draft cannot switch a good drafter off and the cost of drafting is measured,
not assumed.

Each step, for each method, the k over 0..max_k maximising (expected tokens of the batch) /
(predicted step seconds) is taken, the other methods at their current choice; every few
steps a neighbour of the best k is tried so the costs stay identified. Tree methods choose
between off (0), their best node alone (1: a chain of one, the head's likeliest next token) and
their whole tree (``BEST_NODE``: at a big batch a whole tree costs more than it returns where one
node still pays). A method that is off is tried again after
``RETRY_AFTER`` steps, doubling (its acceptance or the load may have changed). A row the
controller let draft that proposed nothing counts as a miss at the first position: a method
that only sometimes has a proposal (prompt lookup, suffix decoding) is worth what it returns
over all its steps. A request that set ``num_speculative_tokens`` keeps it.

>>> c = AdaptiveSpeculation()
>>> rows = [RowView("a", "draft")]
>>> k = c.caps(rows)[0]                     # before any evidence: the prior's choice
>>> for _ in range(200):                    # drafts never accepted, a step costs 1 ms + 0.2 ms/k
...     k = c.caps(rows)[0]
...     c.observe(rows, [k], [0], 0.001 + 0.0002 * k)
>>> c.caps(rows)[0]
0
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np


MIN_GAIN = 0.02
"""Speculating must beat plain decoding's predicted tokens/s by this share to be chosen."""

MIN_TRIES = 3
"""Steps a method drafts in a batch-size bucket before the controller may switch it off there:
what it knows before then (a prior, one noisy step) is too little to judge a drafter by."""

EXPLORE_SLACK = 0.25
"""While exploring, a method drafts unless even its priors, at the costs measured so far (one
step's, perhaps a cold one), promise this much less than plain decoding: so a drafter near
break-even is measured, and one far from it (a big tree in a big batch) is not."""

RETRY_AFTER = (4, 32)
"""A method switched off is tried again (``RETRY_BURST`` steps) after 4 steps, then 8, 16, ...
at most 32 (its acceptance or the load may have changed; a method that stays useless costs
little)."""

RETRY_BURST = MIN_TRIES
"""Steps a retried method drafts before it is judged again, as a new one explores: one step
says little, and a request whose first drafts were unlucky stayed off for good when retries
were single steps (``test_a_drafter_switched_off_by_a_hard_stretch_comes_back_when_it_pays_again``). A
retry step that accepts nothing ends the burst, so a useless drafter costs one step per retry,
and a method the costs turned off (not its acceptance) is retried one step at a time."""

REQUEST_FORGET = 0.9
"""Per step a request drafts (its whole tree or its best node alone), the weight left on its
older acceptance: a text's acceptance changes along it (a hard stretch, then an easy one), so
what a request accepted lately counts most; ``pseudo_counts`` of the method's estimate keep a
few misses from deciding alone."""

PROBE_EVERY = 64
"""A bucket's steps between plain probes: one step with every self-tuned row at k = 0, so the
cost of a plain step stays measured (without it a tree's size alone could not tell its cost
from the step's). The first probe is a bucket's second step; a bucket whose rows decode
plainly anyway needs none."""


PLAIN_ANCHOR = 5.0
"""The plain step's cost is held near the mean of the bucket's plain steps (each plain step
weighing 0.99 of the one after it) with the weight of 5 steps. While a method drafts every step
but the probes (one in ``PROBE_EVERY``), the steps only tell the plain step's cost and a draft's
apart through those probes, which the forgetting soon outweighs: the fit drifted (simulated in
``test_the_plain_steps_cost_holds_while_a_tree_drafts_all_but_the_probes``), and the controller,
finding plain decoding slow and EAGLE-3's whole tree cheap, drafted a tree that ran 0.80x plain
decoding at batch 1 (``python -m specray.bench.selftune --methods eagle3 --prompts 0 --batch 1
--queue 6``: its default 0.90-0.95x there before, 0.99-1.00x after)."""

PLAIN_FORGET = 0.99

NODE_PRIOR = 0.15
"""Before a bucket has measured a method, each of its draft nodes is taken to cost this share
of a plain step."""

BLOCK_PRIOR, BLOCK_NODE_PRIOR = 0.3, 0.05
"""A block method (PARD, DFlash) before it is measured: its one drafting forward costs 0.3 of a
plain step, and each node it drafts only its verification, 0.05."""

OUTLIER = 4.0
"""A step's measured seconds count as at most this many times what the cost model predicted for
it. A garbage-collector pass or a one-time cost (a lazy import, a new shape's first run) can make
one step many times its peers; taken whole, it priced a paying drafter off
(``test_one_slow_step_does_not_switch_a_paying_drafter_off``). A real change in cost still moves
the model: each clipped step pulls it up to 4x what it predicted."""

CLIP_SOLVE_EVERY = 16
"""The outlier clip of a step that drafted reads a cost model solved at most this many steps
ago. Where ``caps`` judges no method (every row's k fixed by its request, or every self-tuned
method probed or staying off) nothing else solves it, and a solve per step would serve only a
bound that a model a few steps old sets as well."""

REJUDGE_OFF_EVERY = 8
"""A method off in a batch-size bucket for more than 8 steps, and not due for a retry, is judged
again every 8 steps there, not every step: by then its costs are measured, only plain steps
add to them while it is off, and they move slowly, while judging it costs a pass over every row
each step (``test_a_method_long_off_is_judged_every_few_steps_not_every_step``). Its first 8
steps off are each judged: there the costs are new (a bucket's first drafting step is often a
cold one) and turned a drafter back on within a few steps
(``test_dflash.py::test_training_learns_and_saves_the_published_layout``)."""

LEARN_EVERY = 32
"""Steps in which the controller decided nothing (every row's k fixed, or plain rows) are
learned from 32 at a time, in order, with the step counts they had (the same state as learning
after each): nothing reads what they teach before a step where it decides, or a request leaves,
and learning calls run right after each compiled forward cost more than run together."""

RETRY_SHARE = 0.01
"""A method its costs switched off is retried no more often than one percent of its bucket's
time pays for, as its cost model prices a retry step: one costing 8 plain steps' time beyond a
plain step comes 800 steps apart at the least (``COSTS_RETRY_AFTER`` is the schedule for cheap
retries)."""

TREE_NODES_FORGET = 0.98
"""A tree's size, as its cost is predicted: the most nodes it drafted lately, each step that drafts
it forgetting 2% of the size seen before. Rows near their last tokens draft trees cut to the
tokens left; taken as the tree's size (the last step's, as before), a queue's tail, where trees
of 1 or 2 nodes were drafted, made a full tree look cheap at the next full batch, which then
drafted a 16-node tree in 8 rows (several plain steps' time) at the start of every batch run."""

BEST_NODE = "@1"
"""A tree method's best node drafted alone (``"eagle@1"``) is a column of its own in the cost
model, one cost whenever it is drafted: it runs one level of the head and verifies one token a
row, while the whole tree's cost is per node of a tree many levels deep; one cost per node for
both priced one of them far off. Its acceptance is the head's top-1 rate, estimated from the
steps that drafted it alone: a whole tree's first depth is accepted when any of its first-level
nodes is, and counted from capped steps the per-depth rates would read a cut tree's missing
siblings as misses (``_top1``). At batch 8 on the demo pair, as a static cap (``python -m
specray.bench.selftune --caps 1``, prefix caching off), EAGLE's and EAGLE-3's best
node alone ran 1.09x plain decoding, their whole trees 0.74-0.79x."""

TREE_TIE = 0.3
"""A tree whose whole tree pays and is predicted within 30% of its best node alone drafts the
whole tree: its steps teach the controller every depth's acceptance and its cost, the best
node's only the first depth's, so between near-equals the best node's choice rests on the
stalest estimates (a request's whole tree priced low by one unlucky step stays so while its best
node drafts); and each rests on a few noisy steps. EAGLE at batch 1 on these CPUs is such a
case (``test_between_near_equals_a_tree_drafts_its_whole_tree`` simulates one). The best node
is taken where the whole tree does not pay (EAGLE and EAGLE-3 at batch 8: their
whole trees 0.74-0.80x plain decoding, their best nodes above it). 20% before: at batch 1 on
these CPUs the two run about as fast over a one-shot request (a whole tree's step costs several
plain steps, its best node's little more than one), and at 20% fresh requests drafted their
best node on many steps, each returning about half a whole tree's tokens per forward."""

COSTS_RETRY_AFTER = (4 * PROBE_EVERY, 16 * PROBE_EVERY)
"""A method its costs switched off (even its priors say it does not pay at this batch size)
is retried one step after 256 steps, then 512, then every 1024. Such a retry re-measures only
the costs, which move slowly with the load, and one retry of a big tree in a big batch costs
several plain steps' time (explicit trees at batch 8 run 0.5-0.7x plain in ``python -m
specray.bench.selftune``), so retrying after 64 and 128 steps, as before, cost a short batch
run more than it could find."""


@dataclass(frozen=True)
class RowView:
    """What the controller knows of a row: its request and method; ``fixed``: the request set
    its speculation size itself (``num_speculative_tokens``, or a tree), which then stands
    (``requested``: that k, None for a tree's own size); ``tree``: the method drafts trees;
    ``block``: it drafts its whole length in one forward."""

    request_id: str
    method: str
    requested: int | None = None
    fixed: bool = False
    tree: bool = False
    block: bool = False


@dataclass
class _Acceptance:
    """Exponentially forgotten counts per draft position (position j at index j - 1)."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def add(self, drafted: int, accepted: int, forget: float) -> None:
        grow = drafted - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        if forget < 1.0:
            self.reached = [r * forget for r in self.reached]
            self.accepted = [a * forget for a in self.accepted]
        for j in range(min(drafted, accepted + 1)):  # positions up to the first rejection were reached
            self.reached[j] += 1.0
            if j < accepted:
                self.accepted[j] += 1.0

    def rate(self, j: int, prior: float, pseudo: float) -> float:
        if j < len(self.reached):
            return (self.accepted[j] + pseudo * prior) / (self.reached[j] + pseudo)
        return prior


@dataclass
class _Pooled(_Acceptance):
    """A method's counts over all its requests, and each request's share of them (its steps,
    forgotten as the method's counts forget them). A request's estimate shrinks towards these
    counts less what its own counts hold (``without``): shrunk towards counts that held its own
    recent steps, a request counted them twice, and where it ran alone (a one-shot ``specray
    generate``, a quiet server) two early misses at a depth weighed as four and priced its
    whole tree off for the rest of the request, the saved acceptance having only the
    pseudo-counts' say. Its older steps, which its own counts have forgotten (they forget
    faster), stay in: a long request alone still learns its method's deep rates from them."""

    forget: float = 1.0
    adds: int = 0  # steps added so far: a share last added to at ``a`` has since been forgotten adds - a times
    shares: dict[str, tuple[_Acceptance, int]] = field(default_factory=dict)

    def add_for(self, request: str, drafted: int, accepted: int) -> None:
        self.add(drafted, accepted, self.forget)
        self.adds += 1
        share, at = self.shares.get(request, (_Acceptance(), self.adds))
        share.add(0, 0, self.forget ** (self.adds - at))  # (scaled to now, as the counts were)
        share.add(drafted, accepted, 1.0)
        self.shares[request] = (share, self.adds)

    def without(self, request: str, own: _Acceptance) -> _Acceptance:
        """These counts less what both they and ``own`` (the request's counts) hold of its
        steps: per position, the smaller of its share here and ``own``."""
        if request not in self.shares:
            return self
        share, scale = self._share(request)
        pad = [0.0] * len(self.reached)
        return self._less([min(scale * m, t) for m, t in zip(share.reached + pad, own.reached + pad)],
                          [min(scale * m, t) for m, t in zip(share.accepted + pad, own.accepted + pad)])

    def fade(self, request: str, factor: float) -> None:
        """Forget all but ``factor`` of ``request``'s share here, as its own counts forget it."""
        if request not in self.shares:
            return
        share, scale = self._share(request)
        cut = (1.0 - factor) * scale
        less = self._less([cut * m for m in share.reached], [cut * m for m in share.accepted])
        self.reached, self.accepted = less.reached, less.accepted
        share.add(0, 0, factor)

    def _share(self, request: str) -> tuple[_Acceptance, float]:
        """``request``'s share, and the factor that scales it to now."""
        share, at = self.shares[request]
        return share, self.forget ** (self.adds - at)

    def _less(self, reached: list[float], accepted: list[float]) -> _Acceptance:
        """These counts less ``reached``/``accepted`` per position, none below 0 and none
        accepted more often than reached."""
        pad = [0.0] * len(self.reached)
        r = [max(c - m, 0.0) for c, m in zip(self.reached, reached + pad)]
        return _Acceptance(r, [min(max(c - m, 0.0), n) for c, m, n in zip(self.accepted, accepted + pad, r)])

    def release(self, request: str) -> None:
        self.shares.pop(request, None)


def _first_pooled(a: _Acceptance, b: _Acceptance) -> _Acceptance:
    """``a`` with ``b``'s first-position counts added to its own first position."""
    if not b.reached:
        return a
    first = lambda xs: xs[0] if xs else 0.0  # noqa: E731
    return _Acceptance([first(a.reached) + b.reached[0], *a.reached[1:]],
                       [first(a.accepted) + b.accepted[0], *a.accepted[1:]])


def _pays(values: list[float], i: int) -> bool:
    """Whether choice ``i`` clearly beats plain decoding (choice 0), as ``_best`` requires."""
    return values[i] >= values[0] * (1 + MIN_GAIN)


def _best(values: list[float]) -> int:
    """The index of the k to take from each k's expected tokens/s: speculate only where it
    clearly pays (noise in measured costs must not keep a useless draft on), and of
    near-equal choices take the shortest."""
    best = int(np.argmax(values))
    if not _pays(values, best):
        return 0
    return next(i for i, v in enumerate(values) if v >= values[best] * (1 - MIN_GAIN / 2))


@dataclass
class _Bucket:
    """A batch-size bucket's exploration: its steps, the last plain one, drafting steps per method."""

    steps: int = 0
    plain_at: int = 0  # its step number of the last step in which no row drafted (0: none yet)
    tries: dict[str, int] = field(default_factory=dict)
    off_since: dict[str, int] = field(default_factory=dict)  # method -> its step when judged off here
    # A method switched off here: [its step when last tried, the retry interval]; retried: the
    # steps it still drafts before it is judged again. Per bucket, as its costs are: a method
    # on at batch 1 (a queue's tail) is no evidence at batch 8, and a retry burst begun at
    # batch 2 drafting into the next batch of 8 cost a full tree in 8 rows every run.
    off: dict[str, list[int]] = field(default_factory=dict)
    burst: dict[str, int] = field(default_factory=dict)


def _bucket(batch: int) -> int:
    return 1 << max(batch - 1, 0).bit_length()  # 1, 2, 4, 8, ...


class _Costs:
    """Step seconds = x . theta, x = [1, k_m for each method, [k_b > 0] for each block method],
    ridge around a prior."""

    def __init__(self, methods: list[str], forget: float, prior_weight: float, blocks: frozenset = frozenset()):
        self.methods, self.forget, self.prior_weight = list(methods), forget, prior_weight
        self.blocks = [m for m in self.methods if m in blocks]
        n = len(self.methods) + len(self.blocks) + 1
        self._xx, self._xy = np.zeros((n, n)), np.zeros(n)
        # Steps added since the sums were last folded: (x, seconds). The sums are folded in
        # when read (a solve), or every CLIP_SOLVE_EVERY steps, all at once: not a few numpy
        # calls on a few numbers every step.
        self._pending: list[tuple[tuple[float, ...], float]] = []
        self.prior: np.ndarray | None = None
        self._first: tuple[dict[str, int], float] | None = None  # the first step, while no plain one was seen
        # The last theta solved, as Python floats: the outlier clip and ``seconds`` multiply it
        # every step, and numpy's matmul of a few numbers costs more than Python's here.
        self._coef: tuple[float, ...] | None = None
        self._seen: set[int] = {0}  # columns some step added had non-zero
        self._known: np.ndarray | None = None  # each column's estimate when its steps last informed it
        self._plain = (0.0, 0.0)  # forgotten sum of plain steps' seconds, and their weight (PLAIN_ANCHOR)
        self.levels: dict[str, int] = {}  # tree method -> its depth (a best node's cost prior: ``add``)
        self._unsolved = 0  # steps added since the last solve (any: coefficients() solves again; a step where caps judged a method shares its solve with add)

    def add(self, ks: dict[str, int], seconds: float) -> None:
        x = self._x(ks)
        # The outlier clip: a step that drafted reads the model as of now where ``caps`` solved
        # it this step, else one solved at most CLIP_SOLVE_EVERY steps ago (caps judged no
        # method: every row's k fixed, or every self-tuned method probed or staying off); a
        # plain step reads the last one solved: a solve there would serve only this clip.
        recent = self._coef is not None and (not any(ks.values()) or self._unsolved < CLIP_SOLVE_EVERY)
        if not recent:
            self.coefficients()
        new = {i for i, v in enumerate(x) if v} - self._seen
        if self._coef is not None and not new:
            seconds = min(seconds, OUTLIER * sum(map(operator.mul, self._coef, x)))
        elif self._coef is not None:
            # A column's first measurement is no outlier (clipped at 4x a guessed prior, a
            # best node's cost took tens of steps to learn) and becomes its prior: a column
            # long unmeasured (switched off) is forgotten back to its prior, and a guessed one
            # made it look cheap again every few hundred steps.
            known = sum(c * v for i, (c, v) in enumerate(zip(self._coef, x)) if i not in new)
            for i in new:
                self.prior[i] = max(seconds - known, 0.0) / sum(x[j] for j in new)
                if self._known is not None:
                    self._known[i] = self.prior[i]
        self._seen |= new
        if not any(ks.values()):
            total, weight = self._plain
            self._plain = (PLAIN_FORGET * total + seconds, PLAIN_FORGET * weight + 1.0)
        if self.prior is None:  # a step costs about this much, each draft token ~15% more
            base = seconds / (1.0 + NODE_PRIOR * sum(ks.values()))
            self.prior = self._guess(base, {})
            self._first = (dict(ks), seconds) if any(ks.values()) else None
        elif self._first is not None and not any(ks.values()):
            # The first plain step (the bucket's probe): the prior's step cost is measured now,
            # and the first step's extra time is its drafts'. A prior guessed from a drafting
            # step alone (each node 15% of a step) makes a plain step far dearer than a big
            # tree's step shows it to be, and with few plain steps to correct it keeps a losing
            # tree on.
            (first, first_s), self._first = self._first, None
            fixed = sum(BLOCK_PRIOR * seconds for m in self.blocks if first.get(m))  # the block forwards
            per_node = max(first_s - seconds - fixed, 0.0) / max(sum(first.values()), 1)
            measured = {m: per_node for m in first if first[m]}
            for m, levels in self.levels.items():
                # A tree's best node alone runs one level of its head and verifies one token:
                # about one level's share of the whole tree's measured cost. At a guessed 15% of
                # a plain step (far below what EAGLE-3's costs on these CPUs) it looked so cheap
                # that every fresh request spent its first judged step on it.
                if first.get(m) and m + BEST_NODE in self.methods and m + BEST_NODE not in first:
                    measured[m + BEST_NODE] = per_node * first[m] / max(levels, 1)
            self.prior = self._guess(seconds, measured)
        self._pending.append((x, seconds))
        if len(self._pending) >= CLIP_SOLVE_EVERY:  # bounded where nothing solves (every row's k fixed, none drafting)
            self._fold()
        self._unsolved += 1

    @property
    def xx(self) -> np.ndarray:
        """sum over steps of forget^age * x x^T (the ridge's normal equations)."""
        self._fold()
        return self._xx

    @property
    def xy(self) -> np.ndarray:
        """sum over steps of forget^age * x * seconds."""
        self._fold()
        return self._xy

    def _fold(self) -> None:
        """The pending steps into the sums, oldest first, each forgotten as if added in turn."""
        if not self._pending:
            return
        xs = np.array([x for x, _ in self._pending])  # [m, n]
        ys = np.array([y for _, y in self._pending])
        w = self.forget ** np.arange(len(xs) - 1, -1, -1, dtype=float)  # the newest weighs 1
        decay = self.forget ** len(xs)
        self._xx = decay * self._xx + (xs * w[:, None]).T @ xs
        self._xy = decay * self._xy + xs.T @ (w * ys)
        self._pending.clear()

    def _guess(self, plain: float, per_node: Mapping[str, float]) -> np.ndarray:
        """A prior: a plain step's seconds, each method's per-node cost (``per_node`` where
        measured, else a share of the plain step), and each block method's one forward."""
        nodes = [per_node.get(m, (BLOCK_NODE_PRIOR if m in self.blocks else NODE_PRIOR) * plain) for m in self.methods]
        return np.array([plain] + nodes + [BLOCK_PRIOR * plain] * len(self.blocks))

    def coefficients(self) -> tuple[float, ...] | None:
        """theta, solved if steps were added since, as Python floats (None before the first
        step): what ``seconds`` multiplies for every candidate k of every method judged."""
        if self.prior is None:
            return None
        if self._unsolved or self._coef is None:
            # A column its recent steps no longer inform (a method off for long) is held at
            # what they last measured, not forgotten back to a first or guessed cost: so
            # forgotten, a long-running server's controller priced EAGLE-3's whole tree at batch
            # 8 as paying (it ran at 7 plain steps' time) and its best node, from one cold first
            # step, as not. (An informed column keeps the prior as its anchor: its steps
            # outweigh it, and where they cannot tell two columns apart, a k always the same,
            # an anchor that followed the estimates drifted.)
            informed = np.diag(self.xx) > self.prior_weight
            if self._known is None or len(self._known) != len(self.prior):
                self._known = self.prior.copy()
            anchor = np.where(informed, self.prior, self._known)
            lam = self.prior_weight * np.eye(len(self.prior))
            if self._plain[1]:
                anchor[0], lam[0, 0] = self._plain[0] / self._plain[1], PLAIN_ANCHOR
            theta = np.maximum(np.linalg.solve(self.xx + lam, self.xy + lam @ anchor), 1e-6)
            self._known = np.where(informed, theta, self._known)
            self._coef = tuple(theta.tolist())
            self._unsolved = 0
        return self._coef

    def theta(self) -> np.ndarray | None:
        """``coefficients()`` as an array."""
        coef = self.coefficients()
        return None if coef is None else np.array(coef)

    def widened(self, methods: Sequence[str], blocks: Sequence[str] = ()) -> "_Costs":
        """This model with ``methods`` added, what it measured kept: a method that joins a
        bucket (per-request speculation: a request of another method arrives) starts from the
        prior, and every step before it drafted none of its nodes (a new method's column is 0).
        A fresh model would forget the others' costs and re-learn them (a useless drafter the
        bucket had switched off drafted again)."""
        out = _Costs(sorted(set(self.methods) | set(methods)), self.forget, self.prior_weight,
                     frozenset(self.blocks) | frozenset(blocks))
        at = ([0] + [1 + out.methods.index(m) for m in self.methods]  # old coordinates in the new
              + [1 + len(out.methods) + out.blocks.index(m) for m in self.blocks])
        out._xx[np.ix_(at, at)], out._xy[at], out._first = self.xx, self.xy, self._first
        out._seen = {at[i] for i in self._seen}
        if self.prior is not None:
            out.prior = out._guess(self.prior[0], {})
            out.prior[at] = self.prior
        if self._known is not None:
            out._known = out.prior.copy()
            out._known[at] = self._known
        out._plain, out.levels = self._plain, dict(self.levels)
        return out

    def seconds(self, coefficients: Sequence[float], ks: dict[str, int]) -> float:
        """Predicted seconds of a step whose methods draft ``ks`` (by name: the bucket's model
        may know methods this step lacks); ``coefficients``: ``coefficients()``."""
        return sum(map(operator.mul, coefficients, self._x(ks)))

    def _x(self, ks: dict[str, int]) -> tuple[float, ...]:
        return (1.0, *(float(ks.get(m, 0)) for m in self.methods), *(float(ks.get(m, 0) > 0) for m in self.blocks))


class AdaptiveSpeculation:
    """The controller (see the module doc). ``caps`` before a step, ``observe`` after it."""

    def __init__(self, max_k: int = 8, prior_acceptance: float = 0.6, pseudo_counts: float = 4.0,
                 forget: float = 0.98, prior_weight: float = 0.3, explore_every: int = 8,
                 priors: Mapping[str, Sequence[float]] | None = None):
        self.max_k, self.prior_acceptance, self.pseudo = max_k, prior_acceptance, pseudo_counts
        self.forget, self.prior_weight, self.explore_every = forget, prior_weight, explore_every
        # method -> acceptance per position measured when its weights were trained (the
        # weights' ``specray_acceptance``): where the estimates start instead of the prior.
        self.priors = {m: [float(r) for r in rates] for m, rates in (priors or {}).items() if rates}
        self._methods: defaultdict[str, _Pooled] = defaultdict(lambda: _Pooled(forget=forget))
        self._requests: defaultdict[str, _Acceptance] = defaultdict(_Acceptance)
        self._costs: dict[int, _Costs] = {}
        self._choice: dict[str, int | None] = {}
        self._nodes: dict[str, float] = {}  # tree methods: the most nodes a tree had lately (TREE_NODES_FORGET)
        # tree methods' best node alone: its acceptance, per method and per request (``BEST_NODE``)
        self._top1: defaultdict[str, _Pooled] = defaultdict(lambda: _Pooled(forget=forget))
        self._requests_top1: defaultdict[str, _Acceptance] = defaultdict(_Acceptance)
        self._on: set[str] = set()  # rows of the last step the controller let draft
        self._alone: set[str] = set()  # of those, the tree rows drafting their best node alone
        self._steps = 0
        self._buckets: defaultdict[int, _Bucket] = defaultdict(_Bucket)  # per batch-size bucket: its exploration so far
        self._blocks: set[str] = set()  # methods that draft a whole block in one forward
        # Expected-token tables, recomputed only when what they read changed: a method's
        # ``_learned`` count grows with every step it drafts (and with new priors), so a step
        # in which a method stays off recomputes none.
        self._learned: dict[str, int] = {}
        self._tables: dict = {}  # request id, or ("prior", method, k): (what it was made from, the table)
        self._decided = True  # the last caps judged a method (its observe learns at once)
        self._unlearned: list[tuple] = []  # steps where caps decided nothing, not yet learned from

    def fresh(self) -> "AdaptiveSpeculation":
        """A controller with these settings and priors that has learned nothing yet."""
        return AdaptiveSpeculation(self.max_k, self.prior_acceptance, self.pseudo, self.forget, self.prior_weight,
                                   self.explore_every, self.priors)

    # -- deciding ------------------------------------------------------------------------------
    def caps(self, rows: Sequence[RowView]) -> list[int | None]:
        """Per row: the most draft nodes it may take this step (None: the method's own size)."""
        self._steps += 1
        self._blocks.update(r.method for r in rows if r.block)
        bucket = self._buckets[_bucket(len(rows))]
        bucket.steps += 1
        self._alone = set()
        if all(r.fixed or r.method == "none" for r in rows):  # nothing to decide (plain rows, given k)
            self._on, self._decided = set(), False
            return [r.requested if r.fixed else None for r in rows]
        auto = {r.method for r in rows if not r.fixed and r.method != "none"}
        if self._all_stay_off(bucket, auto):
            # Every self-tuned method stays off unjudged (``_stays_off``): such a step neither
            # reads nor needs what the steps before it taught, and teaches only what a plain
            # step does, so it is learned from with the steps that decided nothing
            # (``LEARN_EVERY``), answered without the cost model, the probe or a method pass.
            self._on, self._decided = set(), False
            self._choice.update(dict.fromkeys(auto, 0))
            return [r.requested if r.fixed else (None if r.method == "none" else 0) for r in rows]
        self._decided = True
        self._learn_pending()
        methods = sorted({r.method for r in rows if r.method != "none"})
        model = self._cost_model(len(rows), self._columns(rows))
        if model.prior is None or model._first is not None:  # (read once: the prior's first plain step)
            model.levels.update({r.method: self._depth(r) for r in rows if r.tree and not r.fixed})
        measured = model.prior is not None  # (coefficients() is None before the bucket's first step)
        # A plain probe: the bucket has measured drafting, never a plain step (or long ago).
        probe = measured and bucket.steps - bucket.plain_at >= (PROBE_EVERY if bucket.plain_at else 1)
        costs = None  # solved only for a method judged this step: a method that stays off needs none
        tables: dict[bool, dict[str, list[float]]] = {}

        def table(prior_only: bool) -> dict[str, list[float]]:
            """Each row's expected tokens for every k, once per step (not once per candidate
            k): from what was measured, or from the priors alone (what the method should do)."""
            if prior_only not in tables:
                tables[prior_only] = {r.request_id: self._expected_tokens(r, prior_only) for r in rows}
            return tables[prior_only]

        choice = {}
        for m in methods:
            auto = [r for r in rows if r.method == m and not r.fixed]
            if not auto:
                continue
            tree = auto[0].tree
            options = self._tree_options(m) if tree else list(range(self.max_k + 1))
            if probe:
                choice[m] = 0
                continue
            if self._stays_off(bucket, m):
                choice[m] = 0
                continue
            hoped = table(True)
            if not measured:  # no measurement yet: draft, to learn
                choice[m] = None if tree else min(4, self.max_k)
                continue
            costs = model.coefficients() if costs is None else costs
            # What the priors promise at this step's measured costs: while a method is new in
            # this bucket it is judged by that alone (a few drafts say little about a drafter;
            # a step's cost says much), and it tells whether an off method is worth retrying.
            hope = [self._rate(rows, m, k, choice, model, costs, hoped, prior_only=True) for k in options]
            promised = _best(hope)
            if bucket.tries.get(m, 0) < MIN_TRIES:  # exploring: draft unless clearly a loss
                best = 1 + int(np.argmax(hope[1:]))
                if tree and best == 1 and hope[-1] >= hope[1] * (1 - TREE_TIE):
                    best = len(options) - 1  # (as when judged: the whole tree between near-equals)
                best = best if hope[best] >= hope[0] * (1 - EXPLORE_SLACK) else 0
                if not best:  # a clear loss even by its priors: judged, its retries single steps
                    bucket.tries[m] = MIN_TRIES
            else:
                rates = [self._rate(rows, m, k, choice, model, costs, table(False)) for k in options]
                best = _best(rates)
                if tree and best == 1 and _pays(rates, -1) and rates[-1] >= rates[1] * (1 - TREE_TIE):
                    best = len(options) - 1
                if self.explore_every and self._steps % self.explore_every == 0:
                    best = self._neighbour(best, rates, tree)
            choice[m] = options[self._retry(bucket, m, best, promised > 0, lambda: self._price(model, costs, m, tree))]
            if choice[m] == 0:
                bucket.off_since.setdefault(m, bucket.steps)
            else:
                bucket.off_since.pop(m, None)
        self._choice.update(choice)
        caps = [r.requested if r.fixed else choice.get(r.method) for r in rows]
        self._on = {r.request_id for r, k in zip(rows, caps) if not r.fixed and r.method != "none" and k != 0}
        self._alone = {r.request_id for r, k in zip(rows, caps) if r.tree and not r.fixed and k == 1}
        return caps

    def _neighbour(self, best: int, rates: list[float], tree: bool) -> int:
        """Now and then a neighbour of the best choice, so the costs stay identified: a chain's
        k one up or down; a drafting tree's other size every fourth time — its best node alone,
        or its whole tree only while that is predicted to pay (a cold first step can price it
        low; at a big batch it does not pay, and each try costs several plain steps' time). (Its
        best node every time, as before, cost a one-shot request of 64 tokens two of its 16
        forwards at 4 tokens a forward.) A tree that is off is tried again by its retries."""
        if not tree:
            return min(max(best + (1 if (self._steps // self.explore_every) % 2 else -1), 0), self.max_k)
        if best == 0 or len(rates) < 3:
            return best
        whole = len(rates) - 1
        if (self._steps // self.explore_every) % 4:
            return best
        if best == whole:
            return 1
        return whole if _pays(rates, whole) else best

    def _all_stay_off(self, bucket: _Bucket, methods) -> bool:
        """Whether every one of this step's self-tuned ``methods`` stays off unjudged."""
        return all(self._stays_off(bucket, m) for m in methods)

    def _stays_off(self, bucket: _Bucket, method: str) -> bool:
        """Whether ``method``, off in ``bucket`` for more than ``REJUDGE_OFF_EVERY`` steps, stays
        off this step unjudged: not a step to judge it again, no retry burst under way, its
        retry interval not out (``_retry`` decides those)."""
        off = bucket.off_since.get(method)
        if off is None or bucket.steps - off <= REJUDGE_OFF_EVERY or (bucket.steps - off) % REJUDGE_OFF_EVERY == 0:
            return False
        since = bucket.off.get(method)
        return not bucket.burst.get(method) and since is not None and bucket.steps - since[0] < since[1]

    def _price(self, model: _Costs, costs, method: str, tree: bool) -> float:
        """What a retry step of ``method`` costs beyond a plain step, in plain steps (predicted):
        one draft token (a tree's retries draft its best node alone)."""
        plain = model.seconds(costs, {})
        return model.seconds(costs, {method + BEST_NODE if tree else method: 1}) / plain - 1

    def _retry(self, bucket: _Bucket, method: str, best: int, promising: bool, price=lambda: 0.0) -> int:
        """``best``, or 1 (draft again) when the method has been off for its retry interval:
        ``RETRY_AFTER``, doubling, while its priors say it should pay here (its measured
        acceptance turned it off, and may be stale); ``COSTS_RETRY_AFTER``, doubling, when even
        they say it does not (the costs turned it off: they change with the
        load, slowly, a batch size of its own has a bucket of its own, and each retry of a big
        tree in a big batch costs several plain steps' time), and never more often than
        ``RETRY_SHARE`` of the bucket's time pays for (``price``: what a retry step costs beyond a
        plain one, in plain steps)."""
        if best:
            bucket.off.pop(method, None)
            bucket.burst.pop(method, None)
            return best
        if bucket.burst.get(method):
            bucket.burst[method] -= 1
            return 1
        first, most = RETRY_AFTER if promising else COSTS_RETRY_AFTER
        budget = 0 if promising else int(price() / RETRY_SHARE)
        since, interval = bucket.off.setdefault(method, [bucket.steps, max(first, budget)])
        if bucket.steps - since < interval:
            return 0
        later = max(min(2 * interval, most), budget)
        bucket.off[method] = [bucket.steps, later]
        if promising:  # (the costs turned it off: one step re-measures them)
            bucket.burst[method] = RETRY_BURST - 1
        return 1

    def _rate(self, rows, method, k, choice, model, costs, expected, prior_only: bool = False) -> float:
        """Expected tokens per second of the whole batch if ``method`` drafts k (``expected``:
        the rows' tables, from the priors alone where ``prior_only``)."""
        tokens, ks = 0.0, {}
        for r in rows:
            kr = r.requested if r.fixed else (k if r.method == method else
                                              choice.get(r.method, self._choice.get(r.method)))
            if r.tree and not r.fixed and kr == 1:  # its best node alone
                tokens += 1.0 + self._top1_rate(r, prior_only)
                ks[r.method + BEST_NODE] = 1
                continue
            nodes = self._tree_nodes(r) if kr is None else kr
            table = expected[r.request_id]
            tokens += table[0] if r.method == "none" else table[self._depth(r) if kr is None else kr]
            ks[r.method] = max(ks.get(r.method, 0), nodes)
        return tokens / model.seconds(costs, ks)

    def _tree_options(self, method: str) -> list:
        """A tree method's choices: off, its best node alone (where its tree has more), its whole tree."""
        return [0, 1, None] if self._nodes.get(method, 8) > 1 else [0, None]

    def _top1_rate(self, row: RowView, prior_only: bool = False) -> float:
        """P(a tree row's best node alone is accepted): the request's own rate, shrunk towards
        the other requests', shrunk towards the first depth's prior (the saved acceptance of the
        whole tree's first depth: at most what the best node alone achieves, an optimistic start
        that its first measurements correct); ``prior_only``: that prior."""
        prior = self._first_prior(row.method)
        if prior_only:
            return prior
        own, others = self._top1_counts(row)
        return own.rate(0, others.rate(0, prior, self.pseudo), self.pseudo)

    def _first_prior(self, method: str) -> float:
        measured = self.priors.get(method)
        return measured[0] if measured else self.prior_acceptance

    def _top1_counts(self, row: RowView) -> tuple[_Acceptance, _Acceptance]:
        """A tree row's best-node counts: its own, and its method's less its own."""
        own = self._requests_top1.get(row.request_id, _Acceptance())
        pooled = self._top1.get(row.method)
        return own, (pooled.without(row.request_id, own) if pooled is not None else _Acceptance())

    @staticmethod
    def _columns(rows: Sequence[RowView]) -> list[str]:
        """The cost model's columns a step's rows need: each method, and a tree method's best node."""
        methods = {r.method for r in rows if r.method != "none"}
        return sorted(methods | {r.method + BEST_NODE for r in rows if r.tree and r.method != "none" and not r.fixed})

    def _depth(self, row: RowView) -> int:
        """A tree's draft positions so far, or as measured when it was trained (its expected
        tokens: 1 + its mean accepted length)."""
        seen = len(self._methods.get(row.method, _Acceptance()).reached)
        return max(seen, len(self.priors.get(row.method, ())), 1)

    def _expected_tokens(self, row: RowView, prior_only: bool = False) -> list[float]:
        """[E(0), E(1), ...]: expected tokens of a step in which the row drafts k, for every k
        it may take (1.0 for plain rows); ``prior_only``: from the priors, nothing measured."""
        if row.method == "none":
            return [1.0]
        made_from = (row.method, row.requested, self._learned.get(row.method, 0))
        key = ("prior", row.method, row.requested) if prior_only else row.request_id
        cached = self._tables.get(key)
        if cached is None or cached[0] != made_from:
            cached = self._tables[key] = (made_from, self._table(row, prior_only))
        return cached[1]

    def _table(self, row: RowView, prior_only: bool) -> list[float]:
        upto = max(self.max_k, row.requested or 0, self._depth(row))
        own = self._requests.get(row.request_id, _Acceptance()) if not prior_only else _Acceptance()
        pooled = None if prior_only else self._methods.get(row.method)
        method = pooled.without(row.request_id, own) if pooled is not None else _Acceptance()
        out, alive, prior = [1.0], 1.0, self.prior_acceptance
        measured = self.priors.get(row.method)
        for j in range(upto):  # a position never reached inherits the estimate of the one before
            if measured:  # beyond the positions measured, the last one's rate
                prior = measured[min(j, len(measured) - 1)]
            prior = method.rate(j, prior, self.pseudo)
            rate = own.rate(j, prior, self.pseudo)
            if j == 0 and row.tree and not prior_only and row.method in self._top1:
                own_top1, top1 = self._top1_counts(row)
                first = self._first_prior(row.method)
                if rate < own_top1.rate(0, top1.rate(0, first, self.pseudo), self.pseudo):
                    # A tree holds its best node: its first depth is accepted at least as often as
                    # that node alone is. Where the estimates say otherwise (a request drafting its
                    # best node alone, which keeps hitting, after an unlucky whole tree or two; or a
                    # best node's few steps against many whole trees' misses) the first depth is
                    # estimated from both kinds of steps together, each as many as it had: taking
                    # the best node's rate, one lucky step of it kept a tree that never hit drafting,
                    # and ignoring it, a request's whole tree priced off by an unlucky step or two
                    # was not drafted again while its best node paid about as well.
                    prior = _first_pooled(method, top1).rate(j, first, self.pseudo)
                    rate = _first_pooled(own, own_top1).rate(j, prior, self.pseudo)
            alive *= rate
            out.append(out[-1] + alive)
        return out

    def _tree_nodes(self, row: RowView) -> int:
        return self._nodes.get(row.method, 8)

    def _cost_model(self, batch: int, methods: list[str]) -> _Costs:
        bucket = _bucket(batch)
        model = self._costs.get(bucket)
        if model is None:
            model = self._costs[bucket] = _Costs(sorted(methods), self.forget, self.prior_weight, frozenset(self._blocks))
        elif not set(methods) <= set(model.methods):
            model = self._costs[bucket] = model.widened(methods, self._blocks)
        return model

    # -- learning ------------------------------------------------------------------------------
    def observe(self, rows: Sequence[RowView], drafted: Sequence[int], accepted: Sequence[int], seconds: float) -> None:
        """After a step: each row's drafted nodes and accepted count, and the step's seconds.
        A step whose every row asked for plain decoding updates no cost model (no row could
        draft; a plain server's step paid that for nothing) but still counts as the bucket's
        last plain step, so rows that may draft later are not made to probe first. A step
        whose caps decided nothing is learned from later, in order (``LEARN_EVERY``)."""
        bucket = self._buckets.get(_bucket(len(rows)))
        steps = bucket.steps if bucket is not None else 0
        if not self._decided:
            self._decided = True  # (an observe without its caps learns at once)
            self._unlearned.append((rows, list(drafted), list(accepted), seconds, steps))
            if len(self._unlearned) >= LEARN_EVERY:
                self._learn_pending()
            return
        self._learn_pending()
        self._observe(rows, drafted, accepted, seconds, steps, self._on, self._alone)

    def _learn_pending(self) -> None:
        """Learn from the steps not learned from yet, oldest first (their caps let no row
        decide: no row was on)."""
        pending, self._unlearned = self._unlearned, []
        for rows, drafted, accepted, seconds, steps in pending:
            self._observe(rows, drafted, accepted, seconds, steps, frozenset())

    def _observe(self, rows, drafted, accepted, seconds: float, steps: int, on, alone=frozenset()) -> None:
        """``observe`` of a step the bucket counted as its ``steps``-th, ``on``: the rows its
        caps let draft, ``alone``: the tree rows of those it let draft their best node alone."""
        if all(r.method == "none" for r in rows):
            bucket = self._buckets.get(_bucket(len(rows)))
            if bucket is not None:
                bucket.plain_at = steps
            return
        ks: dict[str, int] = {}
        nodes: dict[str, int] = {}
        learned: set[str] = set()
        for r, d, a in zip(rows, drafted, accepted):
            if r.method == "none":
                continue
            if r.request_id in alone:  # its best node alone: the top-1 rate, its own cost column
                ks[r.method + BEST_NODE] = max(ks.get(r.method + BEST_NODE, 0), min(d, 1))
                self._top1[r.method].add_for(r.request_id, 1, min(a, 1))
                self._requests_top1[r.request_id].add(1, min(a, 1), REQUEST_FORGET)
                # A best node that hits says the text may have eased: what the request's whole
                # trees accepted fades as if it had drafted one, in its own counts and in its
                # share of the method's, each at its own rate (a request's recent steps count
                # most). Without this, a request cut to its best node by a hard stretch kept
                # that stretch's deep misses through the easy text after it. A miss fades
                # nothing: faded then too, a tree that never hit was drafted whole every few
                # steps (``test_saved_acceptance_that_serving_contradicts_is_dropped``); and the
                # other requests' counts never fade here (faded towards the saved acceptance,
                # they brought back whole trees that keep missing).
                if r.request_id in self._requests and a > 0:
                    self._requests[r.request_id].add(0, 0, REQUEST_FORGET)
                    self._methods[r.method].fade(r.request_id, self.forget)
                learned.add(r.method)  # (the whole tree's first depth reads it: ``_table``)
                continue
            ks[r.method] = max(ks.get(r.method, 0), d)
            if d <= 0 and r.request_id in on:
                d = 1  # let draft, nothing to propose: a miss at the first position
            elif d <= 0:
                continue
            if r.tree:
                nodes[r.method] = max(nodes.get(r.method, 0), d)
                d = a + 1 if a < d else d  # trees: depth positions up to the first miss were reached
            self._methods[r.method].add_for(r.request_id, d, a)
            self._requests[r.request_id].add(d, a, REQUEST_FORGET)
            learned.add(r.method)
        for m in learned:
            self._learn(m)
        for m, n in nodes.items():
            self._nodes[m] = max(n, TREE_NODES_FORGET * self._nodes.get(m, 0))
        bucket = self._buckets[_bucket(len(rows))]
        for m in [m for m, left in bucket.burst.items() if left]:  # a retry that accepted nothing ends its burst
            if not any(a for r, a in zip(rows, accepted) if r.method == m and r.request_id in on):
                del bucket.burst[m]
        self._blocks.update(r.method for r in rows if r.block)
        self._cost_model(len(rows), self._columns(rows)).add(ks, seconds)
        for m in {r.method for r in rows if r.request_id in on}:
            bucket.tries[m] = bucket.tries.get(m, 0) + 1
        if not any(ks.values()):
            bucket.plain_at = steps

    def _learn(self, method: str) -> None:
        """What ``method``'s tables read changed: they are recomputed when next read."""
        self._learned[method] = self._learned.get(method, 0) + 1

    def release(self, request_id: str) -> None:
        self._learn_pending()
        self._requests.pop(request_id, None)
        self._requests_top1.pop(request_id, None)
        for pooled in (*self._methods.values(), *self._top1.values()):
            pooled.release(request_id)
        self._tables.pop(request_id, None)

    def start_method(self, method: str, rates: Sequence[float]) -> None:
        """A new drafter version serves ``method`` (online learning): forget what the method's
        old version accepted and start from ``rates`` — per draft position, P(accepted | the one
        before accepted), as the version's gate measured it — as a trained head starts from its
        saved acceptance (the same priors)."""
        self._learn_pending()
        self.priors[method] = [min(max(float(r), 0.0), 1.0) for r in rates]
        self._methods.pop(method, None)
        self._top1.pop(method, None)
        for bucket in self._buckets.values():
            bucket.off.pop(method, None)
        self._learn(method)
