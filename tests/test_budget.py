"""The verification budget: which draft slots a step verifies, from acceptance estimates and a
cost table — behaviour through its public interface, and a simulation grid against an oracle
that knows the true per-position acceptance and the true costs."""

import copy
import doctest
import itertools
import random
from typing import Literal

import pytest

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies import budget as B
from specray.policies import costs as C
from specray.policies.base import Draft, DraftRow
from specray.policies.budget import BudgetConfig, RowView, StepRecord, VerificationBudget
from specray.policies.costs import StepCosts, bucket
from specray.policies.registry import LinearOptions, MethodSpec, register_method, unregister_method
from tests.conftest import hf_greedy
from tests.test_engine import ragged_prompts

def test_the_modules_examples_hold():
    for module in (B, C):
        assert doctest.testmod(module).failed == 0


# -- a simulated server: true acceptance per row and position, true costs per shape ------------
class Truth:
    """Step costs in ms: verifying ``size`` tokens (ragged: all rows' together; padded: the widest
    row's, every row that wide) costs ``flat`` until ``per_token`` * tokens exceeds it (a GPU:
    flat, then compute-bound) or ``flat + per_token * tokens`` (a CPU: linear); drafting costs
    ``level`` ms per level (a sequential drafter), growing a little with the batch."""

    def __init__(self, ragged: bool, gpu: bool, level: float = 0.08):
        self.ragged, self.gpu, self.level = ragged, gpu, level

    def verify(self, batch: int, size: int, context=None) -> float:
        tokens = size if self.ragged else batch * size
        return max(1.0, 0.01 * tokens) if self.gpu else 1.0 + 0.06 * tokens

    def draft(self, method: str, batch: int, levels: int, context=None) -> float:
        return self.level * levels * (1 + 0.02 * batch)


def profile(policy: VerificationBudget, truth: Truth, batch: int, max_k: int = 8) -> None:
    """What engine/profile.py measures at start-up: each bucket up to the batch at widths 0, 1,
    2, 4, ... max_k, and the drafter at the smallest and largest bucket, shallow and deep."""
    top = bucket(batch)
    for b in (1 << i for i in range(top.bit_length())):
        for k in C.profile_widths(max_k):
            size = b * (1 + k) if truth.ragged else 1 + k
            policy.costs.record(b, size, truth.verify(b, size), {}, None, profiled=True)
    for b in sorted({1, top}):
        for lv in (1, max_k):
            policy.costs.record(b, 1, None, {"m": (b, lv)}, truth.draft("m", b, lv), profiled=True)


def survival(rates) -> list[float]:
    out, alive = [], 1.0
    for r in rates:
        alive *= r
        out.append(alive)
    return out


class Oracle(VerificationBudget):
    """The same admission, fed the true slot values and the true costs."""

    def __init__(self, truth: Truth, rates: dict[str, list[float]], max_k: int = 8):
        super().__init__(BudgetConfig(max_k=max_k, ragged=truth.ragged), costs=truth)
        self.rates = rates

    def values(self, row: RowView, slots: int, draw: bool = False) -> list[float]:
        return survival(self.rates[row.request_id][:slots])


def true_rate(truth: Truth, rows, caps, rates) -> tuple[float, float]:
    """(expected tokens, true seconds) of a step with these caps."""
    tokens = sum(1 + sum(survival(rates[r.request_id][:c])) for r, c in zip(rows, caps))
    widths = [1 + c for c in caps]
    size = sum(widths) if truth.ragged else max(widths)
    drafting = truth.draft("m", sum(1 for c in caps if c), max(caps)) if any(caps) else 0.0
    return tokens, truth.verify(len(rows), size) + drafting


PROFILES = {
    "confident": lambda i: [0.9] * 8,
    "doubtful": lambda i: [0.25] * 8,
    "mixed": lambda i: [0.92] * 8 if i % 2 else [0.15] * 8,
    "fading": lambda i: [0.95, 0.85, 0.7, 0.55, 0.4, 0.3, 0.2, 0.1],
}


def run(profile_name: str, truth: Truth, batch: int, steps: int = 150, seed: int = 0) -> tuple[float, float]:
    """Goodput (expected tokens per true second) over ``steps`` steps: the policy learning from
    drawn outcomes, and the oracle."""
    rng = random.Random(seed)
    rows = [RowView(f"r{i}", "m") for i in range(batch)]
    rates = {r.request_id: PROFILES[profile_name](i) for i, r in enumerate(rows)}
    policy = VerificationBudget(BudgetConfig(ragged=truth.ragged, prior_acceptance=0.6))
    profile(policy, truth, batch)
    oracle = Oracle(truth, rates)
    got = [0.0, 0.0]
    for _ in range(steps):
        caps = policy.caps(rows)
        accepted = []
        for r, c in zip(rows, caps):
            n = 0
            while n < c and rng.random() < rates[r.request_id][n]:
                n += 1
            accepted.append(n)
        tokens, seconds = true_rate(truth, rows, caps, rates)
        got[0] += tokens
        got[1] += seconds
        drafting = truth.draft("m", sum(1 for c in caps if c), max(caps)) if any(caps) else None
        policy.observe(StepRecord(rows, caps, accepted, [list(range(a + 1)) for a in accepted],
                                  propose_s=drafting, verify_s=seconds - (drafting or 0.0)))
    best = true_rate(truth, rows, oracle.caps(rows), rates)
    return got[0] / got[1], best[0] / best[1]


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("profile_name", list(PROFILES))
def test_the_policy_is_within_5_percent_of_the_oracle(profile_name, gpu, ragged):
    """Goodput over two drawn histories of 120 steps each, at batch 1, 8 and 32."""
    for batch in (1, 8, 32):
        runs = [run(profile_name, Truth(ragged, gpu), batch, steps=120, seed=seed) for seed in (1, 2)]
        policy, oracle = (sum(r[i] for r in runs) for i in (0, 1))
        assert policy >= 0.95 * oracle, (batch, policy / oracle)


def test_the_admission_is_the_best_set_of_caps():
    """Against every cap vector of a small batch (ragged, linear costs): the admitted caps reach
    the highest expected tokens per second."""
    truth = Truth(ragged=True, gpu=False)
    rates = {"a": [0.9, 0.8, 0.7], "b": [0.3, 0.2, 0.1], "c": [0.6, 0.6, 0.6]}
    rows = [RowView(r, "m") for r in rates]
    oracle = Oracle(truth, rates, max_k=3)
    chosen = true_rate(truth, rows, oracle.caps(rows), rates)
    best = max((true_rate(truth, rows, caps, rates) for caps in itertools.product(range(4), repeat=3)),
               key=lambda t: t[0] / t[1])
    assert chosen[0] / chosen[1] == pytest.approx(best[0] / best[1], rel=1e-3)


def test_padded_steps_give_each_method_its_own_depth():
    """Padded (every row as wide as the widest): a free drafter that is always right (suffix on
    re-asked text) keeps its whole length beside a costly doubtful one (a draft model) trimmed
    shallow in the same step — and the caps are the best of every cap vector."""
    class Costs(Truth):
        def draft(self, method, batch, levels, context=None):
            return 0.0 if method == "free" else 0.4 * levels

    truth = Costs(ragged=False, gpu=False)
    rates = {"a": [0.97] * 4, "b": [0.97] * 4, "c": [0.4] * 4, "d": [0.4] * 4}
    rows = [RowView("a", "free"), RowView("b", "free"), RowView("c", "m"), RowView("d", "m")]
    oracle = Oracle(truth, rates, max_k=4)

    def rate(caps) -> float:
        tokens = sum(1 + sum(survival(rates[r.request_id][:c])) for r, c in zip(rows, caps))
        seconds = truth.verify(4, 1 + max(caps))
        for m in ("free", "m"):
            deep = max((c for r, c in zip(rows, caps) if r.method == m), default=0)
            seconds += truth.draft(m, 2, deep) if deep else 0.0
        return tokens / seconds

    caps = oracle.caps(rows)
    assert caps[:2] == [4, 4] and max(caps[2:]) <= 1, caps
    assert rate(caps) == pytest.approx(max(rate(c) for c in itertools.product(range(5), repeat=4)), rel=1e-6)


def test_a_step_measured_as_free_is_kept_plain():
    """A plain step whose seconds read 0 (a clock's resolution) cannot be beaten: no drafts."""
    policy = VerificationBudget()
    policy.costs.record(4, 1, 0.0, {}, None, profiled=True)
    assert policy.caps([RowView(f"r{i}", "m") for i in range(4)]) == [0, 0, 0, 0]


def test_forced_tokens_widen_a_padded_step_so_other_rows_verify_more_for_free():
    """A row whose grammar forces 8 tokens verifies 9 wide whatever the caps: beside it, a
    doubtful free drafter's slots up to that width cost nothing more, and are admitted."""
    class Costs(Truth):
        def draft(self, method, batch, levels, context=None):
            return 0.0

    truth = Costs(ragged=False, gpu=False)
    rates = {"json": [0.5] * 8, "d": [0.5] * 8}
    rows = [RowView("json", "free"), RowView("d", "free")]
    oracle = Oracle(truth, rates, max_k=8)
    alone = oracle.caps(rows)[1]
    beside = oracle.caps(rows, forced=[8, 0])[1]
    assert alone <= 2 and beside == 8, (alone, beside)
    assert oracle.last.tokens == pytest.approx(2 + 8 + 2 * sum(survival([0.5] * 8)))


# -- behaviour ---------------------------------------------------------------------------------
def simulate(policy, rows, rates: dict[str, float], steps: int, rng, stated: dict[str, float] | None = None):
    """``steps`` steps of rows whose every position is accepted with its rate; ``stated``:
    block rows draft 8 slots stating that confidence in each, and are trimmed by it."""
    sizes = []
    for _ in range(steps):
        sizes = policy.caps(rows)
        if stated is not None:
            drafted = [8 if c else 0 for c in sizes]
            sizes = policy.trim(rows, drafted, [[stated[r.request_id]] * d for r, d in zip(rows, drafted)])
        acc = []
        for r, c in zip(rows, sizes):
            n = 0
            while n < c and rng.random() < rates[r.request_id]:
                n += 1
            acc.append(n)
        policy.observe(StepRecord(rows, sizes, acc, [list(range(a + 1)) for a in acc]))
    return sizes


def learned(rates: dict[str, float], steps: int = 60, ragged: bool = True, truth: Truth | None = None, seed: int = 0):
    """A policy after ``steps`` steps of rows whose every position is accepted with its rate."""
    truth = truth or Truth(ragged, gpu=False)
    policy = VerificationBudget(BudgetConfig(ragged=ragged))
    rows = [RowView(r, "m") for r in rates]
    profile(policy, truth, len(rows))
    simulate(policy, rows, rates, steps, random.Random(seed))
    return policy, rows


def test_a_never_right_drafter_is_cut_to_0():
    policy, rows = learned({"a": 0.0})
    assert policy.caps(rows) == [0]


def test_a_confident_row_keeps_its_block_while_a_doubtful_one_is_trimmed():
    policy, rows = learned({"sure": 0.95, "unsure": 0.2})
    sure, unsure = policy.caps(rows)
    assert sure >= 6 and unsure <= 1, (sure, unsure)


def test_costs_that_rise_with_the_batch_trim_more():
    truth = Truth(ragged=True, gpu=False)
    small, rows1 = learned({"a": 0.7}, truth=truth)
    big, rows16 = learned({f"r{i}": 0.7 for i in range(16)}, truth=truth)
    assert sum(big.caps(rows16)) / 16 < small.caps(rows1)[0]


def test_a_request_that_set_its_k_keeps_it_and_plain_rows_stay_plain():
    policy, _ = learned({"a": 0.0})
    rows = [RowView("fixed", "m", requested=3, fixed=True), RowView("plain", "none"), RowView("a", "m")]
    assert policy.caps(rows) == [3, None, 0] or policy.caps(rows)[:2] == [3, 0]


def test_evidence_ages_so_a_drafter_cut_to_0_is_tried_again():
    policy, rows = learned({"a": 0.0})
    tried = []
    for _ in range(400):
        cap = policy.caps(rows)[0]
        tried.append(cap)
        policy.observe(StepRecord(rows, [cap], [0], [[0]]))
    retries = sum(1 for c in tried if c)
    assert 1 <= retries <= len(tried) // 4, retries  # tried again, in proportion to its posterior's doubt


def test_a_tree_is_valued_per_node_and_keeps_its_best_prefix():
    """Tree slots are nodes (parents first): the first node of depth 1 that is always on the
    path is worth keeping, a sibling never on it is not; a cap cuts the tree to a prefix."""
    truth = Truth(ragged=True, gpu=False)
    policy = VerificationBudget(BudgetConfig(ragged=True))
    profile(policy, truth, 1)
    row = RowView("t", "m", tree=True)
    parents = [0, 0, 0, 1, 1, 4]  # nodes 1-3 below the root, 4-5 below node 1, 6 below node 4
    for _ in range(40):
        cap = policy.caps([row])[0]
        drafted = 6 if cap is None else cap
        path = [p for p in (0, 1, 4, 6) if p <= drafted]
        policy.observe(StepRecord([row], [drafted], [len(path) - 1], [path], [parents[:drafted]]))
    values = policy.values(row, 6)
    assert values[0] > 0.8 and values[1] < 0.2 and values[3] > 0.8
    assert policy.caps([row])[0] in (None, 4, 5, 6)


def test_start_method_restarts_from_the_new_rates():
    policy, rows = learned({"a": 0.0})
    policy.start_method("m", [0.9, 0.5])
    fresh = RowView("new", "m")
    assert policy.values(fresh, 3) == pytest.approx([0.9, 0.45, 0.225])


def test_stated_confidences_cut_a_block_row_after_drafting():
    """A confident drafter drafts its whole block once admitted, and each row is cut by the
    confidences its draft states: a sure row keeps its block, a doubtful one is trimmed."""
    truth = Truth(ragged=True, gpu=False)
    policy = VerificationBudget(BudgetConfig(ragged=True))
    profile(policy, truth, 2)
    rows = [RowView("sure", "m", block=True, confident=True), RowView("unsure", "m", block=True, confident=True)]
    assert policy.caps(rows) == [8, 8]  # admitted at the prior: the whole block is drafted
    sure, unsure = policy.trim(rows, [8, 8], [[0.97] * 8, [0.15] * 8])
    assert sure >= 6 and unsure <= 1, (sure, unsure)
    assert policy.trim(rows, [3, 8], [[0.97] * 3, [0.97] * 8])[0] <= 3  # never more than drafted


def test_an_overconfident_head_is_calibrated_by_what_verification_accepts():
    truth = Truth(ragged=True, gpu=False)
    policy = VerificationBudget(BudgetConfig(ragged=True))
    profile(policy, truth, 1)
    rows = [RowView("a", "m", block=True, confident=True)]
    first = policy.trim(rows, [8], [[0.9] * 8])[0]
    last = simulate(policy, rows, {"a": 0.1}, 80, random.Random(0), stated={"a": 0.9})[0]
    assert first >= 6 and last <= 1, (first, last)
    stated, measured, _ = policy.status()["calibration"]["m"][0]
    assert stated == 0.95 and measured < 0.3


def test_the_cost_table_interpolates_and_is_robust_to_one_slow_step():
    c = StepCosts(ragged=True)
    for s in (1.0, 1.0, 1.0, 50.0):  # a collector pause
        c.record(4, 4, s, {}, None)
    c.record(4, 12, 2.0, {}, None)
    assert c.verify(4, 4) == 1.0 and c.verify(4, 8) == pytest.approx(1.5)
    assert c.verify(4, 20) == pytest.approx(3.0)  # beyond: the nearest two's slope
    assert c.verify(3, 4) == 1.0  # a batch of 3 is in bucket 4
    assert c.draft("m", 1, 3) == 0.0  # never measured: free until it is


# -- through the engine, with fake proposers ---------------------------------------------------
class OracleOptions(LinearOptions):
    method: Literal["test_oracle"] = "test_oracle"


class WrongOptions(LinearOptions):
    method: Literal["test_wrong"] = "test_wrong"


class RightDrafter:
    """Drafts the target's own greedy continuation (known in advance): always accepted."""

    references: dict = {}

    def propose(self, rows):
        out = []
        for r in rows:
            prompt = next((p for p in self.references if list(r.token_ids[: len(p)]) == list(p)), None)
            done = len(r.token_ids) - len(prompt) if prompt is not None else 0
            out.append(DraftRow(self.references[prompt][done : done + r.num_tokens] if prompt is not None else []))
        return Draft(out)

    def commit(self, rows):
        pass

    def release(self, slot):
        pass


class WrongDrafter(RightDrafter):
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
    RightDrafter.references = {tuple(p): hf_greedy(tiny_pair[0], p, 200) for p in prompts}
    register_method(MethodSpec("test_oracle", OracleOptions, build=lambda ctx: RightDrafter()))
    register_method(MethodSpec("test_wrong", WrongOptions, build=lambda ctx: WrongDrafter()))
    yield prompts
    unregister_method("test_oracle")
    unregister_method("test_wrong")


def served(tiny_pair, prompts, method: str):
    """The fakes' prompts served greedily by ``method`` under the budget: the engine's totals,
    the outputs checked against the target's own continuations first."""
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=2), target_model=copy.deepcopy(tiny_pair[0]))
    outs = engine.generate(prompts, SamplingParams(max_tokens=150, temperature=0, ignore_eos=True),
                           SpeculationParams(method=method))
    assert [o.token_ids for o in outs] == [RightDrafter.references[tuple(p)][:150] for p in prompts]
    return engine.totals


def test_the_engine_drafts_long_for_a_drafter_that_is_always_right(tiny_pair, fakes):
    m = served(tiny_pair, fakes, "test_oracle")
    assert m.num_draft_tokens / m.num_drafts >= 5 and m.num_accepted_tokens >= 0.9 * m.num_draft_tokens


def test_the_engine_stops_drafting_for_a_drafter_that_is_never_right(tiny_pair, fakes):
    m = served(tiny_pair, fakes, "test_wrong")
    assert m.num_accepted_tokens == 0 and m.num_draft_tokens < m.target_forward_passes  # mostly plain


def test_the_engine_honours_an_explicit_k(tiny_pair, fakes):
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=2), target_model=copy.deepcopy(tiny_pair[0]))
    sampling = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = engine.generate(fakes, sampling, SpeculationParams(method="test_wrong", num_speculative_tokens=2))
    m = engine.totals
    assert m.num_drafts >= sum(len(o.token_ids) for o in outs) - 2 * len(fakes)  # drafted every step
    assert m.num_draft_tokens <= 2 * m.num_drafts and m.num_accepted_tokens == 0


def test_the_engine_profiles_its_cost_table_at_start_up(tiny_pair):
    """Every batch-size bucket at several widths (0, 1, 2, 4, 8 drafts a row) and the draft
    model's levels are measured at a short and a long context before the first request, and
    nothing of the profile stays in the totals."""
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, profile_costs=True), target_model=copy.deepcopy(tiny_pair[0]),
                       draft_model=copy.deepcopy(tiny_pair[1]))
    table = engine.driver.length_policy.costs.table()
    contexts = {k.split("@")[-1] for k in table["verify"]}
    assert len(contexts) == 2, table
    shapes = {k.split("@")[0] for k in table["verify"]}
    assert {"1x1", "1x9", "2x1", "4x1", "4x9"} <= shapes, table  # (widest row: padded steps)
    assert all(sum(k.startswith(f"{b}x") for k in shapes) >= 3 for b in (1, 2, 4)), table
    assert {f"draft@{s}@{c}" for s in ("1x1", "1x8", "4x8") for c in contexts} <= set(table["draft"]), table
    assert engine.profile_seconds > 0 and engine.totals.num_drafts == 0
    assert engine.driver.length_policy.status() == {"costs": table, "calibration": {}, "last": None,
                                                    "totals": {"steps": 0, "rows": 0, "slots": 0}}


def test_served_steps_scale_a_profiled_curve_so_no_entry_goes_stale():
    """The profile gives the curve's shape; served steps at one size (longer contexts: twice the
    profile's seconds) move every size alike, and one slow served step moves nothing."""
    c = StepCosts()
    for size, s in ((1, 1.0), (2, 1.2), (9, 3.0)):
        c.record(8, size, s, {}, None, profiled=True)
    for s in (2.0, 2.0, 2.0, 40.0):
        c.record(8, 1, s, {}, None)
    assert (c.verify(8, 1), c.verify(8, 2), c.verify(8, 9)) == pytest.approx((2.0, 2.4, 6.0))


def test_a_step_is_priced_at_its_context_between_the_profiled_ones():
    """Attention grows with the context and the rest of a forward with the tokens verified: at
    a long context a wider step costs relatively less, and a served step at a long context
    is priced there (it does not read as a slower machine)."""
    c = StepCosts()
    for size, short, long in ((1, 1.0, 3.0), (5, 3.0, 4.0)):
        c.record(32, size, short, {}, None, profiled=True, context=24)
        c.record(32, size, long, {}, None, profiled=True, context=224)
    assert c.verify(32, 5, context=24) / c.verify(32, 1, context=24) == pytest.approx(3.0)
    assert c.verify(32, 5, context=124) / c.verify(32, 1, context=124) == pytest.approx(3.5 / 2.0)
    for _ in range(3):
        c.record(32, 1, 3.0, {}, None, context=224)
    assert c.level == pytest.approx(1.0)
