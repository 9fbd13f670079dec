"""The self-tuning speculation length: k = 0 when drafts are never accepted, a large k when
they always are, an explicit k honoured — alone and driving the engine with fake proposers."""

import copy
from typing import Literal

import pytest

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies.base import Draft, DraftRow
from specray.policies.controller import AdaptiveSpeculation, RowView
from specray.policies.registry import LinearOptions, MethodSpec, register_method, unregister_method
from tests.conftest import hf_greedy
from tests.test_engine import ragged_prompts


def simulate(acceptance: float, steps: int = 300, batch: int = 1, draft_cost: float = 0.2, block: float | None = None,
             verify_cost: float = 0.0) -> int:
    """A step costs 1 + draft_cost * k (ms) — or, for a block drafter, 1 + block + verify_cost * k
    whenever it drafts (one forward whatever k); each draft position is accepted with ``acceptance``."""
    import random

    rng = random.Random(0)
    c = AdaptiveSpeculation()
    rows = [RowView(f"r{i}", "m", block=block is not None) for i in range(batch)]
    taken = []
    for _ in range(steps):
        ks = c.caps(rows)
        taken.append(ks[0])
        accepted = []
        for k in ks:
            n = 0
            while n < k and rng.random() < acceptance:
                n += 1
            accepted.append(n)
        k = max(ks)
        cost = 1 + draft_cost * k if block is None else 1 + (block + verify_cost * k if k else 0)
        c.observe(rows, ks, accepted, 0.001 * cost)
    last = taken[-40:]  # what it settled on: the k most of its last steps took (not a neighbour tried, or a retry)
    return max(set(last), key=last.count)


def test_controller_turns_speculation_off_when_nothing_is_accepted():
    assert simulate(0.0) == 0


def test_controller_drafts_long_when_everything_is_accepted():
    assert simulate(1.0) >= 6


def test_controller_in_between():
    mid = simulate(0.7)
    assert 1 <= mid <= 6 and simulate(0.7, draft_cost=2.0) < mid  # costlier drafts: shorter


def test_a_block_drafter_is_priced_as_one_forward_per_block():
    """Drafting costs a block drafter one forward whatever k: at the same acceptance it drafts
    longer than a drafter paying per token whose total cost at k = 4 is the same, and it is
    still switched off when nothing is accepted."""
    per_token = simulate(0.7, draft_cost=0.25)
    block = simulate(0.7, block=0.9, verify_cost=0.025)
    assert block > per_token and block >= 5, (block, per_token)
    assert simulate(0.0, block=0.9, verify_cost=0.025) == 0


def test_one_slow_step_does_not_switch_a_paying_drafter_off(monkeypatch):
    """A step 60x its peers (a full garbage-collector pass, a one-time lazy cost) counts as at
    most ``OUTLIER`` times what the cost model predicted: the drafter that pays stays on. Taken
    whole, that one step priced drafting off for the rest of the run."""
    import math

    from specray.policies import controller

    def chosen_after_a_slow_step() -> list[int]:
        return _chosen_with_a_slow_step(AdaptiveSpeculation(), lambda step: [RowView("r", "m")], 60)[20:]

    assert sum(k > 0 for k in chosen_after_a_slow_step()) >= 36
    monkeypatch.setattr(controller, "OUTLIER", math.inf)
    assert sum(k > 0 for k in chosen_after_a_slow_step()) <= 10


def _chosen_with_a_slow_step(c, rows_at, steps: int) -> list[int]:
    """Run ``c`` for ``steps`` steps of the rows ``rows_at(step)``: 80% acceptance per position,
    a step costing 1 ms + 0.2 ms a draft token, step 10 60x that. Returns each step's k."""
    import random

    rng, chosen = random.Random(0), []
    for step in range(steps):
        rows = rows_at(step)
        k = c.caps(rows)[0]
        chosen.append(k)
        n = 0
        while n < k and rng.random() < 0.8:
            n += 1
        c.observe(rows, [k], [n], 0.001 * (1 + 0.2 * k) * (60.0 if step == 10 else 1.0))
    return chosen


def test_a_slow_step_among_fixed_k_steps_is_clipped_too():
    """Steps whose rows all set their k (the controller decides nothing, ``caps`` solves no
    model) still clip an outlier against the model: one slow step there, taken whole, priced
    drafting off for the self-tuned requests that came after it."""
    fixed, auto = [RowView("f", "m", requested=4, fixed=True)], [RowView("a", "m")]
    chosen = _chosen_with_a_slow_step(AdaptiveSpeculation(), lambda step: fixed if step < 30 else auto, 90)
    assert sum(k > 0 for k in chosen[30:]) >= 50


@pytest.mark.parametrize("subtracted", [True, False])
def test_a_gc_pause_is_not_a_steps_cost(make_engine, monkeypatch, subtracted):
    """A full collection inside a step (many steps' time with a loaded engine in the process) is left out
    of the seconds the controller is told the step cost (engine/gc_pauses.py); timed whole, it
    read as the drafts' cost. The pause here: a collector callback that sleeps 0.3 s."""
    import gc
    import time

    from specray.engine import driver as driver_module
    from specray.engine.gc_pauses import gc_seconds

    engine = make_engine(max_num_seqs=2)
    engine.driver.clock = time.perf_counter
    policy, seen = engine.driver.length_policy, []
    observe, verify = policy.observe, engine.driver.executor.verify
    monkeypatch.setattr(policy, "observe", lambda rows, d, a, s: (seen.append(s), observe(rows, d, a, s)))

    async def collecting_verify(*args):
        gc.collect()
        return await verify(*args)

    monkeypatch.setattr(engine.driver.executor, "verify", collecting_verify)
    if not subtracted:
        monkeypatch.setattr(driver_module, "gc_seconds", lambda: 0.0)
    gc_seconds()  # the timer is registered first: the pause below falls inside its window
    pause = lambda phase, info: time.sleep(0.3) if phase == "start" else None  # noqa: E731
    gc.callbacks.append(pause)
    try:
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0), SpeculationParams(method="draft"))
    finally:
        gc.callbacks.remove(pause)
    assert seen and (max(seen) < 0.2 if subtracted else min(seen) >= 0.3), seen


def test_fixed_requests_keep_their_k():
    c = AdaptiveSpeculation()
    rows = [RowView("a", "m", requested=3, fixed=True), RowView("b", "n")]
    for _ in range(100):
        ks = c.caps(rows)
        c.observe(rows, ks, [0, 0], 0.001 * (1 + 0.2 * ks[0] + 0.2 * ks[1]))
    c._steps = 1
    assert c.caps(rows) == [3, 0]  # never accepted: the free row stops, the fixed one keeps 3


# -- through the engine, with fake proposers ---------------------------------------------------
class OracleOptions(LinearOptions):
    method: Literal["test_oracle"] = "test_oracle"


class WrongOptions(LinearOptions):
    method: Literal["test_wrong"] = "test_wrong"


class Oracle:
    """Drafts the target's own greedy continuation (known in advance): always accepted."""

    references: dict = {}

    def propose(self, rows):
        out = []
        for r in rows:
            ref = next(v for p, v in self.references.items() if list(r.token_ids[: len(p)]) == list(p))
            done = len(r.token_ids) - len(next(p for p in self.references if list(r.token_ids[: len(p)]) == list(p)))
            out.append(DraftRow(ref[done : done + r.num_tokens]))
        return Draft(out)

    def commit(self, rows):
        pass

    def release(self, slot):
        pass


class Wrong(Oracle):
    """Drafts a token the target does not choose: never accepted (and, like a real drafter,
    drafting costs time per token)."""

    def propose(self, rows):
        import time

        time.sleep(0.0005 * max((r.num_tokens for r in rows), default=0))
        right = super().propose(rows)
        return Draft([DraftRow([(t + 1) % 64 for t in d.tokens]) for d in right.rows])


@pytest.fixture(scope="module")
def fakes(tiny_pair):
    prompts = ragged_prompts(6)
    Oracle.references = {tuple(p): hf_greedy(tiny_pair[0], p, 200) for p in prompts}
    register_method(MethodSpec("test_oracle", OracleOptions, build=lambda ctx: Oracle()))
    register_method(MethodSpec("test_wrong", WrongOptions, build=lambda ctx: Wrong()))
    yield prompts
    unregister_method("test_oracle")
    unregister_method("test_wrong")


@pytest.mark.parametrize("method, expect", [("test_oracle", "long"), ("test_wrong", "off")])
def test_the_engine_learns_k(tiny_pair, fakes, method, expect):
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=2), target_model=copy.deepcopy(tiny_pair[0]))
    sampling = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    outs = engine.generate(fakes, sampling, SpeculationParams(method=method))
    assert [o.token_ids for o in outs] == [Oracle.references[tuple(p)][:150] for p in fakes]
    choice = engine.driver.length_policy._choice[method]
    m = engine.totals
    if expect == "long":
        assert choice >= 6 and m.num_draft_tokens / m.num_drafts >= 5
    else:
        assert choice == 0 and m.num_drafts < m.target_forward_passes / 3  # it stopped drafting early


def test_the_engine_honours_an_explicit_k(tiny_pair, fakes):
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=2), target_model=copy.deepcopy(tiny_pair[0]))
    sampling = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = engine.generate(fakes, sampling, SpeculationParams(method="test_wrong", num_speculative_tokens=2))
    m = engine.totals
    assert m.num_drafts >= sum(len(o.token_ids) for o in outs) - 2 * len(fakes)  # drafted every step
    assert m.num_draft_tokens <= 2 * m.num_drafts and m.num_accepted_tokens == 0


# -- where it starts: the acceptance saved with trained weights, and a short exploration ------
def one_shot(acceptance: float, priors: dict, steps: int = 24, unlucky: int = 0, tree: bool = False,
             batch: int = 1, draft_cost: float = 0.1, unlucky_acceptance: float = 0.0) -> list:
    """A fresh controller over ``steps`` steps of ``batch`` rows of method "m" (a tree of 8 nodes
    and depth 5, or a chain of k): each position accepted with ``acceptance``, with
    ``unlucky_acceptance`` in the first ``unlucky`` steps (the steps, drafting or not, a text's
    hard part lasts); a step costs sqrt(batch) * (1 + draft_cost * nodes) ms, a tree's as
    ``tree_cost`` prices it. The caps it chose."""
    return simulate_tree_or_chain(acceptance, priors, steps, unlucky, tree, batch, draft_cost, unlucky_acceptance)[0]


def simulate_tree_or_chain(acceptance: float, priors: dict, steps: int, unlucky: int = 0, tree: bool = False, batch: int = 1,
             draft_cost: float = 0.1, unlucky_acceptance: float = 0.0, top1: float | None = None,
             seed: int = 0) -> tuple[list, AdaptiveSpeculation]:
    """``one_shot``, a tree's best node alone accepted with ``top1`` (None: ``acceptance``), from
    ``seed``: the caps chosen, and the controller."""
    import random

    rng = random.Random(seed)
    c = AdaptiveSpeculation(priors=priors)
    rows = [RowView(f"r{i}", "m", tree=tree) for i in range(batch)]
    chosen = []
    for step in range(steps):
        ks = c.caps(rows)
        drafted = [8 if k is None else k for k in ks]
        accepted = []
        for k in ks:
            n = 0
            rate = acceptance if step >= unlucky else unlucky_acceptance
            # (a whole tree holds its best node: its first depth is accepted at least as often)
            first = top1 if tree and top1 is not None else rate
            while n < (5 if k is None else min(k, 5)):
                p = first if n == 0 else rate
                if p <= 0 or rng.random() >= p:
                    break
                n += 1
            accepted.append(n)
        extra = tree_cost(ks[0], draft_cost) if tree else draft_cost * max(drafted)
        c.observe(rows, drafted, accepted, 0.001 * batch ** 0.5 * (1 + extra))
        chosen.append(ks[0])
    return chosen, c


def tree_cost(k, draft_cost: float, nodes: int = 8, depth: int = 5) -> float:
    """What a tree step costs beyond a plain step, in plain steps, in these simulations: a level
    of the head 1.2 * draft_cost, a node verified 0.25 * draft_cost; the whole tree (k None) has
    ``depth`` levels and ``nodes`` nodes (at the defaults: 8 * draft_cost), a tree cut to k
    nodes min(k, depth) levels (EAGLE-2 grows k levels under a cap of k): its best node alone
    (k = 1) one level and one node."""
    if k == 0:
        return 0.0
    levels, n = (depth, nodes) if k is None else (min(k, depth), k)
    return draft_cost * (1.2 * levels + 0.25 * n)


@pytest.mark.parametrize("tree", [False, True])
def test_a_saved_acceptance_keeps_a_good_drafter_on_through_an_unlucky_start(tree):
    """A one-shot request of a drafter trained to 0.8 acceptance whose first drafts all miss:
    it drafts every step but the plain probe, the bucket's second (a fresh controller once
    switched EAGLE off after two drafts and decoded plainly for the rest of a 64-token
    `generate`)."""
    saved = {"m": [0.8] * 5}
    chosen = one_shot(0.8, saved, unlucky=3, tree=tree)
    assert [i for i, k in enumerate(chosen) if k == 0] == [1], chosen
    if tree:  # without the saved acceptance the same unlucky start leaves it drafting its best node
        nodes = lambda ks: sum(8 if k is None else k for k in ks[2:11])  # noqa: E731
        assert nodes(chosen) > 1.3 * nodes(one_shot(0.8, {}, unlucky=3, tree=True))


def test_a_drafter_switched_off_by_a_hard_stretch_comes_back_when_it_pays_again(monkeypatch):
    """A tree that accepts little for a while (rightly cut to its best node, then switched off)
    and then well again is back on for most of the rest: it is retried (its best node alone, ``RETRY_AFTER``), and a
    request's recent acceptance counts most (``REQUEST_FORGET``). Never retried, it stays off
    for good."""
    from specray.policies import controller

    run = dict(acceptance=0.85, priors={"m": [0.8] * 5}, steps=60, unlucky=12, tree=True, draft_cost=0.2,
               unlucky_acceptance=0.2)
    chosen = one_shot(**run)
    # the hard stretch: down to its best node alone, then off (a lone request's own misses
    # counted once, not again in its method's counts: off after about 10 steps, not 8)
    assert sum(k == 0 for k in chosen[4:12]) >= 2 and None not in chosen[6:12], chosen
    assert sum(k != 0 for k in chosen[30:]) >= 24, chosen  # and on again once drafts pay
    monkeypatch.setattr(controller, "RETRY_AFTER", (10**6, 10**6))
    assert sum(k != 0 for k in one_shot(**run)[30:]) < 24


def test_a_request_cut_to_its_best_node_by_a_hard_stretch_drafts_whole_trees_again_after_it(monkeypatch):
    """A tree whose first token stays easy (best node right 0.85 of the time) and whose deeper
    depths are hard for 12 steps, then easy (0.85 a depth): the request drafts its best node
    alone through the stretch, and its whole tree again after it about twice as often as when
    its best-node hits left the stretch's deep misses unfaded, in its own counts and in its
    share of the method's (``_observe``); where the text stays hard, its whole tree is still
    drafted on few steps (8 seeds x 48 steps; measured 268 and 132 whole trees, and 49 where it
    stays hard)."""
    from specray.policies import controller as C

    def whole_trees(deep: float, hard: int) -> int:
        return sum(simulate_tree_or_chain(deep, {"m": [0.8] * 5}, 64, unlucky=hard, tree=True, draft_cost=0.25,
                                          unlucky_acceptance=0.4, top1=0.85, seed=seed)[0][16:].count(None)
                   for seed in range(8))

    eases, stays_hard = whole_trees(0.85, 12), whole_trees(0.4, 64)
    assert stays_hard <= 0.15 * 8 * 48, stays_hard
    add = C._Acceptance.add
    monkeypatch.setattr(C._Acceptance, "add", lambda self, d, a, f: None if d == 0 else add(self, d, a, f))
    monkeypatch.setattr(C._Pooled, "fade", lambda self, request, factor: None)
    assert eases >= 1.5 * whole_trees(0.85, 12), eases


@pytest.mark.parametrize("tree", [False, True])
def test_saved_acceptance_that_serving_contradicts_is_dropped(tree):
    """Weights that promised 0.8 but are never accepted here are switched off after a few
    steps and only retried now and then (a chain at k = 1, a tree a few times)."""
    chosen = one_shot(0.0, {"m": [0.8] * 5}, steps=80, tree=tree)
    later = [k for k in chosen[40:] if k != 0]
    assert (len(later) <= 3) if tree else (len(later) <= 8 and set(later) == {1}), chosen


def test_a_costly_tree_in_a_big_batch_is_turned_off_whatever_was_saved():
    chosen = one_shot(0.8, {"m": [0.8] * 5}, steps=40, tree=True, batch=16, draft_cost=1.0)
    assert sum(k != 0 for k in chosen[10:]) <= 3, chosen


@pytest.mark.parametrize("rate, draft_cost, first, gaps", [(0.8, 1.0, 256, [512, 1024]), (0.8, 2.0, 290, [580, 1024])])
def test_a_tree_its_costs_switched_off_is_retried_ever_more_rarely(rate, draft_cost, first, gaps):
    """Retries of a tree the costs switched off (every size of it) come 256, 512, then 1024 steps
    apart: a new batch size has a bucket of its own. A retry drafts the tree's best node, and
    none comes sooner than RETRY_SHARE of the bucket's time pays for: at 2.0 a node costs 2.9
    plain steps beyond one (``tree_cost``), so 290 steps first, then twice that (at 1.0, 145:
    the schedule stands). The best node's cost, measured once, stays what it was while it is
    off (a guessed prior, forgotten back to, made it look cheap again every few hundred
    steps)."""
    chosen = one_shot(rate, {"m": [rate] * 5}, steps=2500, tree=True, batch=16, draft_cost=draft_cost)
    retries = [i for i, k in enumerate(chosen) if k != 0 and i >= 10]
    steps = [b - a for a, b in zip(retries, retries[1:])][:2]
    assert first - 6 <= retries[0] <= first + 14 and len(steps) == 2 and all(abs(s - g) <= 8 for s, g in zip(steps, gaps)), retries
    assert all(chosen[i] == 1 for i in retries), "a retry drafts the best node alone"


def test_a_buckets_costs_are_read_by_method():
    """A batch-size bucket that has seen two methods judges each by its own cost per node: a
    drafter whose nodes each cost a whole step, half accepted, is switched off, although the
    other method the bucket knows drafts almost for free."""
    import random

    rng = random.Random(0)
    c = AdaptiveSpeculation(priors={"cheap": [0.9] * 8, "dear": [0.5] * 8})

    def run(method: str, steps: int, per_node: float, rate: float) -> list:
        rows, chosen = [RowView("r-" + method, method)], []
        for _ in range(steps):
            k = c.caps(rows)[0]
            accepted = 0
            while accepted < k and rng.random() < rate:
                accepted += 1
            c.observe(rows, [k], [accepted], 0.001 * (1 + per_node * k))
            chosen.append(k)
        return chosen

    assert sum(run("cheap", 30, 0.02, 0.9)[-10:]) > 0
    dear = run("dear", 60, 1.0, 0.5)
    assert sum(k > 0 for k in dear[-30:]) <= 3, dear  # retries only


def test_a_method_joining_a_bucket_keeps_what_it_measured():
    """Per-request speculation: a request of another method joining a batch-size bucket adds
    that method to the bucket's costs; the costs measured so far stay, so a useless drafter
    the bucket switched off stays off in the step the newcomer joins (a fresh cost model had
    every method of that step draft to learn)."""
    c = AdaptiveSpeculation(priors={"bad": [0.05] * 8, "good": [0.9] * 8})
    bad = [RowView("r-bad-1", "bad"), RowView("r-bad-2", "bad")]
    for _ in range(40):  # "bad" drafts, never accepted, each node a tenth of a step
        ks = c.caps(bad)
        c.observe(bad, ks, [0, 0], 0.002 * (1 + 0.1 * max(ks)))
    assert c.caps(bad) == [0, 0]
    c.observe(bad, [0, 0], [0, 0], 0.002)
    mixed = [bad[0], RowView("r-good", "good")]  # one "bad" request finished, a "good" one joined
    ks = c.caps(mixed)
    assert ks[0] == 0 and ks[1] != 0, ks


def test_a_block_method_joining_a_bucket_gets_its_forward_column():
    """A block drafter (PARD, DFlash) joining a bucket: the costs measured so far stay where
    they were, and its one forward per block is a column of its own, priced from the plain
    step until it is measured."""
    from specray.policies import controller

    c = AdaptiveSpeculation()
    per_token = [RowView("a", "m"), RowView("b", "m")]
    for _ in range(30):
        ks = c.caps(per_token)
        c.observe(per_token, ks, [0, 0], 0.002 * (1 + 0.1 * max(ks)))
    before = c._costs[2].theta()
    mixed = [per_token[0], RowView("c", "blk", block=True)]
    c.caps(mixed)
    model = c._costs[2]
    assert model.methods == ["blk", "m"] and model.blocks == ["blk"]
    theta = model.theta()
    assert theta[0] == pytest.approx(before[0], rel=0.05) and theta[2] == pytest.approx(before[1], rel=0.05)
    assert theta[3] == pytest.approx(controller.BLOCK_PRIOR * model.prior[0])  # nothing measured: the prior


class _Uncached(AdaptiveSpeculation):
    """The controller with every expected-token table computed afresh, as before the cache."""

    def _expected_tokens(self, row, prior_only=False):
        return [1.0] if row.method == "none" else self._table(row, prior_only)


def test_cached_tables_decide_as_fresh_ones():
    """Over random steps of two methods (a tree and a chain), requests coming and going and
    acceptance changing, the controller that reuses its expected-token tables until what they
    read changed chooses exactly what one that recomputes them every step chooses."""
    import random

    rng = random.Random(5)
    cached, fresh = (cls(priors={"t": [0.7, 0.5, 0.4]}) for cls in (AdaptiveSpeculation, _Uncached))
    live = [RowView(f"r{i}", "t" if i % 2 else "c", tree=bool(i % 2)) for i in range(6)]
    made = 6
    for step in range(400):
        if rng.random() < 0.05:  # a request ends, another starts
            gone = live.pop(rng.randrange(len(live)))
            cached.release(gone.request_id), fresh.release(gone.request_id)
            method = rng.choice("tc")
            live.append(RowView(f"r{made}", method, tree=method == "t"))
            made += 1
        rows = live[: rng.randint(1, len(live))]
        got, want = cached.caps(rows), fresh.caps(rows)
        assert got == want, step
        rate = 0.8 if step < 150 else 0.1
        drafted = [8 if k is None else k for k in got]
        accepted = [sum(1 for _ in range(min(d, 5)) if rng.random() < rate) for d in drafted]
        seconds = 0.001 * (1 + 0.3 * max(drafted))
        cached.observe(rows, drafted, accepted, seconds), fresh.observe(rows, drafted, accepted, seconds)


def test_a_method_long_off_is_judged_every_few_steps_not_every_step(monkeypatch):
    """At batch 8 a tree its costs switched off is judged (its expected tokens per second
    computed) on about one step in REJUDGE_OFF_EVERY once it has been off a while, and still
    retried on time: judging every step was most of the controller's time there."""
    from specray.policies import controller as C

    c = AdaptiveSpeculation(priors={"m": [0.8] * 5})
    rows = [RowView(f"r{i}", "m", tree=True) for i in range(8)]
    judged, rate = [], C.AdaptiveSpeculation._rate
    monkeypatch.setattr(C.AdaptiveSpeculation, "_rate", lambda self, *a, **kw: judged.append(self._steps) or rate(self, *a, **kw))
    chosen = []
    for _ in range(600):
        ks = c.caps(rows)
        chosen.append(ks[0])
        drafted = [8 if k is None else k for k in ks]
        c.observe(rows, drafted, [min(2, d) for d in drafted], 0.001 * (1 + tree_cost(ks[0], 2.0)))
    late = {s for s in judged if 100 <= s < 250}
    assert chosen[100:250].count(0) == 150 and len(late) <= 20, sorted(late)  # 150 steps judged every 8th
    # the costs retry still comes: after the 290 steps RETRY_SHARE allows a retry (the tree's best
    # node) 2.9 plain steps dear
    assert any(k != 0 for k in chosen[285:]) and not any(k != 0 for k in chosen[250:285]), "the costs retry"


def test_steps_whose_rows_all_decode_plainly_by_request_teach_nothing():
    """Rows that asked for plain decoding (method none) cannot draft: a step of only those
    leaves no cost model to update (a plain server paid that on every step), and a row that
    may draft still starts its bucket as a fresh one does (its first step drafts)."""
    c = AdaptiveSpeculation()
    plain = [RowView("a", "none"), RowView("b", "none")]
    for _ in range(3):
        assert c.caps(plain) == [None, None]
        c.observe(plain, [0, 0], [0, 0], 0.01)
    assert c._costs == {}
    mixed = [RowView("a", "none"), RowView("c", "draft")]
    assert c.caps(mixed)[1] > 0
    # ... and they still count as the bucket's plain steps: after a long plain stretch, a row
    # that may draft is not held to a plain probe first (the probe measures plain decoding,
    # which those steps just did).
    c.observe(mixed, [0, 4], [0, 2], 0.012)
    for _ in range(100):
        c.caps(plain)
        c.observe(plain, [0, 0], [0, 0], 0.01)
    assert c.caps(mixed)[1] > 0


def test_the_cost_sums_fold_as_sequential_updates_and_stay_bounded():
    """The cost model folds its steps into its sums when a solve reads them: the sums equal
    the per-step forgetting update (forget * sum + x x^T, in order), and steps that nothing
    solves (every row's k fixed, none drafting) do not pile up unfolded."""
    import numpy as np

    from specray.policies.controller import _Costs

    c = _Costs(["draft", "ngram"], 0.98, 0.3)
    xx, xy = np.zeros((3, 3)), np.zeros(3)
    rng = np.random.default_rng(0)
    for i in range(300):
        ks = {"draft": int(rng.integers(0, 5)), "ngram": int(rng.integers(0, 3))}
        seconds = 0.004 + 0.001 * ks["draft"] + 0.0005 * ks["ngram"]
        c.add(ks, seconds)
        x = np.array([1.0, ks["draft"], ks["ngram"]])
        # the sequential update, with the step's outlier clip as ``add`` applied it
        clipped = seconds if c._coef is None else min(seconds, 4.0 * float(np.array(c._coef) @ x))
        xx, xy = 0.98 * xx + np.outer(x, x), 0.98 * xy + x * clipped
        if i % 7 == 0:
            c.theta()
        assert len(c._pending) < 16
    np.testing.assert_allclose(c.xx, xx, rtol=1e-9)
    np.testing.assert_allclose(c.xy, xy, rtol=1e-9)
    plain = _Costs(["draft"], 0.98, 0.3)
    plain.theta()
    for _ in range(1000):  # plain steps read the last solve; nothing solves here
        plain.add({"draft": 0}, 0.004)
    assert len(plain._pending) < 16


@pytest.mark.parametrize("seed", [0, 1])
def test_steps_it_decided_nothing_in_are_learned_later_as_if_at_once(monkeypatch, seed):
    """Steps whose caps decided nothing (every row's k given, or plain rows) are learned from
    ``LEARN_EVERY`` at a time: over a random mix of such steps, self-tuned steps, plain steps,
    two batch sizes and requests that leave, every caps answers and the learned state equal a
    controller that learns after every step."""
    import random

    import numpy as np

    from specray.policies import controller

    def run(learn_every: int):
        monkeypatch.setattr(controller, "LEARN_EVERY", learn_every)
        rng = random.Random(seed)
        c, answers, n = AdaptiveSpeculation(), [], 0
        for step in range(400):
            kind = rng.choice(["fixed", "fixed", "fixed", "auto", "plain", "mixed"])
            size = rng.choice([1, 3])
            if rng.random() < 0.05:
                n += 1  # the rows of earlier steps leave
                c.release(f"r{n - 1}-0")
            rows = [RowView(f"r{n}-{i}", "none" if kind == "plain" else "m",
                            requested=4 if kind == "fixed" or (kind == "mixed" and i) else None,
                            fixed=kind == "fixed" or (kind == "mixed" and i > 0)) for i in range(size)]
            ks = c.caps(rows)
            answers.append(ks)
            drafted = [k if k is not None else 0 for k in ks]
            accepted = [rng.randint(0, k) for k in drafted]
            c.observe(rows, drafted, accepted, 0.001 * (1 + 0.15 * max(drafted)) * rng.uniform(0.9, 1.1))
        c._learn_pending()
        state = ({m: (a.reached, a.accepted) for m, a in c._methods.items()},
                 {r: (a.reached, a.accepted) for r, a in c._requests.items()},
                 {b: (m.methods, np.asarray(m.xx).tolist(), np.asarray(m.xy).tolist(), m.coefficients())
                  for b, m in c._costs.items()},
                 {b: (k.steps, k.plain_at, k.tries, k.off_since, k.off, k.burst) for b, k in c._buckets.items()})
        return answers, state

    every = controller.LEARN_EVERY
    assert every > 1
    later, at_once = run(every), run(1)
    assert later == at_once


def test_a_tree_off_at_a_big_batch_stays_off_after_a_tail_of_short_trees_that_paid():
    """A queue through 8 slots ends in a tail at small batches, where a tree pays and rows near
    their last tokens draft trees cut to 1 or 2 nodes. The next full batch judges the tree at its
    own size (the most nodes it drafted lately, ``TREE_NODES_FORGET``), not the tail's cut one,
    and its best node alone at its own, so it stays off there; and it is retried after that bucket's
    own steps (retry state is per batch-size bucket, as costs are), whatever the tail did, no
    more often than ``RETRY_SHARE`` of its time pays for."""

    c = AdaptiveSpeculation()

    def run(batch: int, steps: int, tag: str, room: int = 64) -> int:
        rows = [RowView(f"{tag}{i}", "tree", tree=True) for i in range(batch)]
        drafted = 0
        for step in range(steps):
            caps = c.caps(rows)
            # rows near their last tokens draft what is left (a tree of 16 nodes, 5 levels deep)
            nodes = [0 if k == 0 else min(16 if k is None else k, room - step) for k in caps]
            drafted += any(nodes)
            base, cost = (0.010, 0.8) if batch == 8 else (0.007, 0.1)  # a whole tree: 9x a plain step at 8, 2x at 1
            c.observe(rows, nodes, [min(3, n) for n in nodes], base * (1 + tree_cost(max(nodes), cost)))
        return drafted

    first = run(8, 60, "a")
    assert 1 <= first <= 3  # it explored, then the costs turned the tree off
    for rnd in range(3):  # each round: the queue's tail at batch 1, its trees cut short, then a full batch again
        assert run(1, 12, f"t{rnd}-", room=14) >= 8
        assert run(8, 60, f"b{rnd}-") == 0
    # Its retries (its best node alone: 1.16 plain steps beyond one, which RETRY_SHARE allows
    # every 116 steps) after 256 of that bucket's steps, then 512: the batch-8 steps so far are
    # 240, and it went off at its third.
    assert run(8, 500, "c") == 1  # at its step 259
    assert run(8, 200, "d") == 1  # at 771


@pytest.mark.parametrize("seed", [0, 1])
def test_steps_where_every_method_stays_off_are_learned_later_as_if_at_once(monkeypatch, seed):
    """A step whose every self-tuned method stays off unjudged (a tree long off at a big batch)
    is answered without the cost model and learned from with the steps that decided nothing:
    over a queue's runs (full batches where a tree's costs switch it off, tails at batch 1 where
    it pays, a second method's rows, requests leaving) every caps answer and the learned state
    equal a controller that judges and learns every such step."""
    import random

    import numpy as np

    def run(fast: bool):
        if not fast:
            monkeypatch.setattr(AdaptiveSpeculation, "_all_stay_off", lambda self, bucket, methods: False)
        rng = random.Random(seed)
        c, answers, offs = AdaptiveSpeculation(priors={"m": [0.7] * 5}), [], 0
        for wave in range(6):
            for step in range(300):
                size = 8 if step < 280 else 1
                rows = [RowView(f"w{wave}-{i}", "m" if i != 7 else "draft", tree=i != 7) for i in range(size)]
                if rng.random() < 0.02:
                    c.release(rows[0].request_id)
                ks = c.caps(rows)
                answers.append(ks)
                offs += all(k == 0 for k in ks)
                drafted = [(16 if k is None else k) for k in ks]
                accepted = [min(d, rng.randint(0, 4)) for d in drafted]
                per_node, level = (0.005, 0.8) if size == 8 else (0.0004, 0.03)
                tree = tree_cost(ks[0], level, nodes=16)  # (a whole tree: 16 nodes; at batch 8, 11x a plain step)
                chain = drafted[7] if size == 8 else 0
                c.observe(rows, drafted, accepted, (0.01 * (1 + tree) + per_node * chain) * rng.uniform(0.9, 1.1))
        c._learn_pending()
        state = ({m: (a.reached, a.accepted) for m, a in c._methods.items()},
                 {r: (a.reached, a.accepted) for r, a in c._requests.items()},
                 {b: (m.methods, np.asarray(m.xx).tolist(), np.asarray(m.xy).tolist(), m.coefficients())
                  for b, m in c._costs.items()},
                 {b: (k.steps, k.plain_at, k.tries, k.off_since, k.off, k.burst) for b, k in c._buckets.items()},
                 c._choice, c._nodes)
        return answers, state, offs

    fast, slow = run(True), run(False)
    assert fast[2] > 1000  # most full-batch steps had every method off
    assert fast[:2] == slow[:2]


# -- a tree's best node alone --------------------------------------------------------------------
def big_batch(top1: float, depth_rates: float, steps: int, level_cost: float = 0.4, seed: int = 0,
              batch: int = 8) -> tuple[list, AdaptiveSpeculation]:
    """``steps`` steps of ``batch`` rows of a tree method (8 nodes, depth 5) whose best node alone is
    accepted with ``top1`` and whose whole tree reaches each depth with ``depth_rates``, as saved
    with it; a step costs what ``tree_cost`` prices at ``level_cost`` a level beyond a plain step
    (at 0.4: the whole tree 3.2 plain steps, its best node 0.58). The caps chosen, and the
    controller."""
    return simulate_tree_or_chain(depth_rates, {"m": [depth_rates] * 5}, steps, tree=True, batch=batch, draft_cost=level_cost,
                    top1=top1, seed=seed)


def test_at_a_big_batch_a_tree_too_dear_whole_drafts_its_best_node_alone():
    """The whole tree returns 3.7 tokens for 4.2 plain steps' time (0.88x plain decoding), its
    best node 1.75 for 1.58 (1.11x): the controller drafts the best node most steps, where one
    that chose only between the whole tree and nothing (as before) decoded plainly. A best node
    that is rarely right is switched off too."""
    chosen, c = big_batch(top1=0.75, depth_rates=0.8, steps=300)
    assert chosen[50:].count(1) >= 200 and chosen[50:].count(None) <= 30, chosen
    # its acceptance is learned apart from the whole tree's per depth (counted there, a best
    # node's misses would read as misses of a whole tree's first depth)
    assert 0.65 < c._top1["m"].accepted[0] / c._top1["m"].reached[0] < 0.85
    rows = [RowView(f"r{i}", "m", tree=True) for i in range(8)]
    per_depth, top1 = copy.deepcopy(c._methods["m"]), c._top1["m"].accepted[0]
    assert c.caps(rows) == [1] * 8
    c.observe(rows, [1] * 8, [0] * 8, 0.00158)
    assert c._methods["m"] == per_depth and c._top1["m"].accepted[0] < top1  # (8 misses)
    bad, _ = big_batch(top1=0.1, depth_rates=0.8, steps=300)
    assert bad[50:].count(0) >= 220, bad  # (its retries aside)


def test_a_new_cost_columns_first_measurement_is_taken_whole():
    """The best node's first step costs 3 plain steps beyond one, far above the guessed prior
    (15% of a plain step): taken whole (not clipped at 4x the prediction) it prices the best
    node off at once, and stays its prior while it is off."""
    c = AdaptiveSpeculation(priors={"m": [0.6] * 5})
    rows = [RowView(f"r{i}", "m", tree=True) for i in range(8)]
    first = None
    for step in range(40):
        ks = c.caps(rows)
        if ks[0] == 1 and first is None:
            first = step
        extra = {0: 0.0, 1: 3.0, None: 6.0}[ks[0]]
        drafted = [8 if k is None else k for k in ks]
        c.observe(rows, drafted, [min(d, 1) for d in drafted], 0.001 * (1 + extra))
    model = c._costs[8]
    theta = dict(zip(["1", *model.methods], model.coefficients()))
    assert first is not None and abs(theta["m@1"] / theta["1"] - 3.0) < 0.5, theta


def test_between_near_equals_a_tree_drafts_its_whole_tree(monkeypatch):
    """At batch 1, where the whole tree (3.7 tokens for 3 plain steps' time) and the best node
    alone (1.8 for 1.36) run within 7% of each other, the tree drafts its whole tree most steps
    (``TREE_TIE``: its steps teach every depth, the best node's only the first); judged by the
    predicted rates alone it drafts mostly the best node, by its stalest estimates."""
    from specray.policies import controller as C

    chosen, _ = big_batch(top1=0.8, depth_rates=0.8, steps=200, level_cost=0.25, batch=1)
    assert chosen[20:].count(None) >= 150, chosen
    monkeypatch.setattr(C, "TREE_TIE", 0.0)
    chosen, _ = big_batch(top1=0.8, depth_rates=0.8, steps=200, level_cost=0.25, batch=1)
    assert chosen[20:].count(1) >= 90, chosen


def test_a_cost_unmeasured_for_long_stays_what_it_was_last_measured():
    """A method drafted for a while (each draft node 0.5 ms beyond a 1 ms step; its first, cold
    step three times that), then off for 500 steps: its cost stays about what its steps
    measured. Forgotten back to its prior (its first step's, 1.5 ms a node), a long-running
    server's controller priced a tree wrongly for good (EAGLE-3's at batch 8: its whole tree
    paying, its best node not)."""
    from specray.policies.controller import _Costs

    costs = _Costs(["m"], forget=0.98, prior_weight=0.3)
    for step in range(100):
        k = 4 * (step % 2)
        costs.add({"m": k}, 0.001 + 0.0005 * k * (3 if step == 1 else 1))
    for _ in range(500):
        costs.add({"m": 0}, 0.001)
    plain, per_node = costs.coefficients()
    assert abs(plain - 0.001) < 1e-5 and abs(per_node - 0.0005) < 5e-5, (plain, per_node)


@pytest.mark.parametrize("seed", range(4))
def test_the_plain_steps_cost_holds_while_a_tree_drafts_all_but_the_probes(seed, monkeypatch):
    """A tree drafting its whole tree (1.3 ms a node beyond a 10 ms plain step) or its best node
    (4 ms beyond), 40 steps each in turn, a plain probe every 64 steps, every step's time 15%
    noisy: the plain step's cost stays within 0.7 ms of 10 over 1500 steps (``PLAIN_ANCHOR``).
    Left to the fit alone it strays 0.9-1.7 ms: only the rare probes tell a plain step from a
    draft, and at batch 1 EAGLE-3's default, finding plain decoding slow, drafted a tree running
    0.8x plain."""
    import random

    from specray.policies import controller as C

    def worst() -> float:
        rng, costs, out = random.Random(seed), C._Costs(["m", "m@1"], forget=0.98, prior_weight=0.3), 0.0
        for step in range(1500):
            if step % 64 == 1:
                ks, t = {}, 0.010
            elif (step // 40) % 2:
                ks, t = {"m": 16}, 0.010 + 16 * 0.0013
            else:
                ks, t = {"m@1": 1}, 0.014
            costs.add(ks, t * rng.uniform(0.85, 1.15))
            if step > 100:
                out = max(out, abs(costs.coefficients()[0] - 0.010))
        return out

    assert worst() < 0.0007
    monkeypatch.setattr(C, "PLAIN_ANCHOR", 0.0)
    assert worst() > 0.0009


def test_a_lone_requests_own_misses_count_once():
    """A request's estimate shrinks towards its method's counts less its own recent steps: a
    request alone (a one-shot ``specray generate``) whose first two whole trees missed at the
    second depth is judged by those two misses against the saved acceptance, not by them twice
    (once as its own, once as its method's, which held only them: so priced, the whole tree
    stayed off for the rest of such requests). Another request's steps still count as the
    method's."""
    from specray.policies import controller as C

    def depth2(with_other: bool, monkeypatch=None) -> float:
        c = AdaptiveSpeculation(priors={"m": [0.8] * 5})
        a, b = RowView("a", "m", tree=True), RowView("b", "m", tree=True)
        for _ in range(2):
            c.observe([a], [8], [1], 0.003)  # the first depth accepted, the second missed
        if with_other:
            for _ in range(6):
                c.observe([b], [8], [5], 0.003)
        table = c._expected_tokens(a)
        return (table[2] - table[1]) / (table[1] - table[0])  # P(depth 2 | depth 1)

    own = C.REQUEST_FORGET
    # its two misses, against the saved 0.8 (and the little of them its own counts forgot faster
    # than its method's: 0.53)
    alone = (0 + 4 * 0.8) / (1 + own + 4)
    assert abs(depth2(False) - alone) < 0.015
    assert depth2(True) > alone + 0.05  # the other request's hits move what it shrinks towards
    twice = C._Pooled.without
    C._Pooled.without = lambda self, request, own: self
    try:
        assert depth2(False) < alone - 0.1  # (counted twice)
    finally:
        C._Pooled.without = twice


def test_a_tree_best_nodes_cost_starts_from_one_level_of_its_whole_tree():
    """Before its best node alone is drafted, its cost is taken as one level's share of the
    whole tree's measured cost (its first step, less the probe's plain step), not 15% of a plain
    step: so priced, a fresh request's first judged step went to its best node, which at batch 1
    on these CPUs costs far more than that."""
    c = AdaptiveSpeculation(priors={"m": [0.8] * 5})
    rows = [RowView("r", "m", tree=True)]
    assert c.caps(rows) == [None]
    c.observe(rows, [8], [2], 0.001 * (1 + 2.5))  # the whole tree: 2.5 plain steps beyond one
    assert c.caps(rows) == [0]  # the probe
    c.observe(rows, [0], [0], 0.001)
    model = c._costs[1]
    prior = dict(zip(["1", *model.methods], model.prior))
    assert abs(prior["m@1"] - 0.0025 / 5) < 1e-9, prior  # one of its five levels


def test_a_tree_drafting_its_whole_tree_tries_its_best_node_every_32_steps():
    """At batch 1 where the whole tree pays, its best node alone is tried as a neighbour every
    fourth exploring step (32 steps), as the whole tree is from its best node: each such step
    returns about half a whole tree's tokens, and every eighth step cost a one-shot request of
    64 tokens two of its 16 forwards at 4 tokens a forward."""
    chosen, _ = big_batch(top1=0.8, depth_rates=0.8, steps=200, level_cost=0.25, batch=1)
    tried = [i for i, k in enumerate(chosen) if k == 1 and i >= 50]  # (after its first steps)
    assert tried and all(b - a >= 32 for a, b in zip(tried, tried[1:])), tried
