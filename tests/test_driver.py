"""The one step driver: every layout runs it, a fake executor sees its protocol, and a new
method is its own file plus a spec (here: a toy method defined in this test alone)."""

from __future__ import annotations

import copy
from typing import Literal

import pytest
import ray
import torch

from specray.engine.config import EngineConfig
from specray.engine.driver import StepDriver, run_sync
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.intake import RequestMaker
from specray.engine.scheduler import Scheduler
from specray.engine.step import verify_inputs
from specray.engine.accept import TargetScores, accept_verified
from specray.policies.base import Draft, DraftRow
from specray.policies.registry import Limits, LinearOptions, MethodSpec, register_method, unregister_method
from tests.conftest import hf_greedy
from tests.test_engine import GREEDY, ragged_prompts

VOCAB = 16


class FakeExecutor:
    """A 'target' that always continues with (last token + 1) % V; a 'proposer' that
    guesses that rule for the first two nodes and then a wrong token."""

    def __init__(self):
        self.calls: list[str] = []
        self.kept: list = []
        self.proposer_rows: dict = {}

    async def prefill(self, reqs, sampled):
        self.calls.append("prefill")
        return TargetScores([[(r.prompt_ids[-1] + 1) % VOCAB] for r in reqs], [], None)

    async def propose(self, plan):
        self.calls.append("propose")
        parts = {}
        for method, (_, rows) in plan.rows.items():
            drafts = []
            for row in rows:
                last = row.token_ids[-1]
                guess = [(last + 1) % VOCAB, (last + 2) % VOCAB, (last + 7) % VOCAB][: row.num_tokens]
                drafts.append(DraftRow(guess))
            parts[method] = Draft(drafts)
        return parts

    async def verify(self, reqs, drafts):
        self.calls.append("verify")
        inputs = verify_inputs(reqs, drafts)
        return accept_verified(reqs, drafts, TargetScores([[(t + 1) % VOCAB for t in row] for row in inputs.tokens], [], None))

    def apply(self, commit):
        self.calls.append("apply")
        self.kept += commit.target_keep
        for method, rows in commit.proposer_rows.items():
            self.proposer_rows.setdefault(method, []).extend(row for _, row in rows)

    def release(self, slots):
        self.calls.append("release")


def test_driver_protocol_with_a_fake_executor():
    limits = Limits(capacity=64, vocab_size=VOCAB, methods={"none": {}, "ngram": {}})
    scheduler = Scheduler(2)
    executor = FakeExecutor()
    driver = StepDriver(scheduler, executor, capacity=64)
    spec = SpeculationParams(method="ngram", num_speculative_tokens=3)
    scheduler.add(RequestMaker(limits).make([1, 2, 3], SamplingParams(max_tokens=7, temperature=0), spec))
    outputs = []
    while scheduler.has_unfinished():
        outputs += run_sync(driver.step())
    tokens = sum((o.new_token_ids for o in outputs), [])
    assert tokens == [4, 5, 6, 7, 8, 9, 10]  # the target's rule, whatever the drafts
    assert executor.calls[:5] == ["prefill", "apply", "propose", "verify", "apply"]
    assert executor.calls[-1] == "release"
    # Two of three drafted nodes accepted each full step: paths 0..2, kept from the root.
    assert executor.kept[0] == (0, 3, [0, 1, 2])
    commits = executor.proposer_rows["ngram"]
    assert commits[0].slot == 0 and commits[1].num_accepted == 2 and commits[1].tokens == [5, 6, 7]
    assert outputs[1].step["accepted"] == [5, 6] and outputs[1].step["rejected"] == [11]


# -- a toy method: this file and its spec are all it takes ------------------------------------
class RepeatOptions(LinearOptions):
    """Guess that the last token repeats."""

    method: Literal["toy_repeat"] = "toy_repeat"
    max_run: int = 8


class RepeatProposer:
    def propose(self, rows):
        return Draft([DraftRow([row.token_ids[-1]] * min(row.num_tokens, row.options.max_run)) for row in rows])

    def commit(self, rows):
        pass

    def release(self, slot):
        pass


def _check(options, facts, limits):
    if options.max_run > limits.capacity:
        raise ValueError("speculation.max_run: longer than the context")


@pytest.fixture(scope="module")
def toy_method():
    register_method(MethodSpec("toy_repeat", RepeatOptions, build=lambda ctx: RepeatProposer(), check=_check))
    yield
    unregister_method("toy_repeat")


def test_a_toy_method_is_one_spec(toy_method, tiny_pair):
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(tiny_pair[0]))
    prompts = ragged_prompts(6) + [[5, 5, 5, 5, 5]]
    spec = SpeculationParams(method="toy_repeat", num_speculative_tokens=3)
    outs = engine.generate(prompts, GREEDY, spec)
    assert [o.token_ids for o in outs] == [hf_greedy(tiny_pair[0], p, GREEDY.max_tokens) for p in prompts]
    assert engine.totals.num_drafts > 0
    with pytest.raises(ValueError, match="max_run: longer than the context"):
        engine.add_request([1, 2], GREEDY, SpeculationParams(method="toy_repeat", max_run=10**6))
    with pytest.raises(ValueError, match="max_run"):
        SpeculationParams(method="toy_repeat", max_run="many")


def test_every_layout_runs_the_same_driver(tiny_checkpoints, tiny_coordinator, tiny_colocated_coordinator):
    """In-process, colocated and separate: the engine worker holds an LLMEngine whose
    step is StepDriver.step; in the separate layout the draft is a proxy to its own actor."""
    engine = LLMEngine(EngineConfig(target=tiny_checkpoints["target"], draft=tiny_checkpoints["draft"]))
    assert type(engine.driver) is StepDriver
    for mode, c in (("separate", tiny_coordinator), ("colocated", tiny_colocated_coordinator)):
        workers = ray.get(c.workers.remote())
        worker = workers["target" if mode == "separate" else "engine"]
        out = ray.get(c.generate.remote([[1, 2, 3]], {"max_tokens": 8, "temperature": 0},
                                        {"method": "draft", "num_speculative_tokens": 2}))[0]
        assert out["metrics"]["num_drafts"] > 0
        described = ray.get(worker.describe.remote())
        assert described["driver"] == "specray.engine.driver.StepDriver"
        assert described["executor"] == "specray.engine.executor.LocalExecutor"
        expected = "specray.actors.proposer_proxy.RemoteProposer" if mode == "separate" else \
            "specray.policies.draft_model.DraftModelProposer"
        assert described["proposers"]["draft"] == expected


def test_run_sync_refuses_a_step_that_waits():
    async def waits():
        import asyncio

        await asyncio.sleep(0.01)

    with pytest.raises(RuntimeError, match="event loop"):
        run_sync(waits())


def test_tensor_view_of_a_draft():
    d = Draft([DraftRow([1, 2]), DraftRow([]), DraftRow([3], probs=torch.ones(1, 4) / 4)])
    assert d.tokens.tolist() == [[1, 2], [0, 0], [3, 0]] and d.lengths.tolist() == [2, 0, 1]
    assert d.probs.shape == (3, 2, 4) and float(d.probs[2, 0].sum()) == pytest.approx(1.0)


def test_rows_handed_features_keep_every_field_and_the_right_positions():
    """``CommitRow.with_features`` copies the row's fields without its ``__init__``: a field
    added to CommitRow and not carried fails here. ``_with_features`` hands each commit row the
    features of its kept path, by one gather for the batch, or (one token a row: plain steps)
    the batch's rows as they are; both are copies (a fixed-shape step reuses its buffer)."""
    import dataclasses

    from specray.engine.executor import _with_features
    from specray.policies.base import CommitRow

    row = CommitRow(3, [5, 6], [0, 2], None, [9])
    feats = torch.randn(2, 1)
    new = row.with_features(feats)
    assert type(new) is CommitRow and row.features is None
    assert dataclasses.astuple(dataclasses.replace(new, features=None)) == dataclasses.astuple(row)
    assert new.features is feats and new == dataclasses.replace(row, features=feats)
    for q in (1, 3):
        batch = torch.randn(3, q, 4)
        rows = [(2, CommitRow(7, [1], [0])), (0, CommitRow(4, [1, 2][:q], [0, 2][:q]))]
        got = _with_features(rows, batch)
        assert [i for i, _ in got] == [2, 0]
        for (i, r), (_, g) in zip(rows, got):
            assert torch.equal(g.features, batch[i, r.path]) and (g.slot, g.tokens, g.path) == (r.slot, r.tokens, r.path)
        batch.zero_()  # the buffer rewritten: what was handed over stays
        assert all(g.features.abs().sum() > 0 for _, g in got)


def test_a_filled_draft_keeps_every_field():
    """``DraftRow.filled`` (the device step's read-back) is ``dataclasses.replace`` spelled out:
    a field added to DraftRow and not carried there fails here."""
    import dataclasses

    from specray.policies.base import ExtraNodes
    from specray.kernels.tree import TokenTree

    fields = [f.name for f in dataclasses.fields(DraftRow)]
    d = DraftRow([0, 0], TokenTree.from_parents([0, 0]), torch.ones(2, 4) / 4,
                 ExtraNodes([5], [1], torch.ones(1, 4, dtype=torch.bool)))
    tree = TokenTree.from_parents([0, 1])
    for new, want in ((d.filled([7, 8]), dataclasses.replace(d, tokens=[7, 8])),
                      (d.filled([7, 8], tree), dataclasses.replace(d, tokens=[7, 8], tree=tree))):
        assert all(getattr(new, f) is getattr(want, f) or getattr(new, f) == getattr(want, f) for f in fields)
