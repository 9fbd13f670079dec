"""Failure containment: a row whose proposer or verification raises fails alone.

A toy method raises for one poisoned request, in each phase of a step (its prefill hook,
its proposal, the target's verification of its draft, its commit hook). That request
finishes with finish_reason 'error' and the message; every other request in the same
batches, of the same method or another, finishes exactly as plain greedy decoding would,
and the engine goes on serving new requests. Eager and fixed-shape steps alike.
"""

from __future__ import annotations

import copy
from typing import Literal

import pytest

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SpeculationParams
from specray.policies.base import Draft, DraftRow
from specray.policies.registry import LinearOptions, MethodSpec, register_method, unregister_method
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.test_engine import GREEDY, ragged_prompts

POISON = [63, 63, 63, 63]  # the prompt that starts so is the one that fails
VOCAB = 64
PHASE = {"now": "propose"}


class FailOptions(LinearOptions):
    """Guess that the last token repeats; raise for poisoned requests in one phase."""

    method: Literal["toy_fail"] = "toy_fail"


class FailingProposer:
    def __init__(self, phase: str):
        self.phase, self.poisoned = phase, set()

    def prefill(self, rows):
        for row in rows:
            if list(row.token_ids[: len(POISON)]) == POISON:
                self.poisoned.add(row.slot)
                if self.phase == "prefill":
                    raise ValueError("poisoned prompt in prefill")

    def propose(self, rows):
        drafts = []
        for row in rows:
            bad = row.slot in self.poisoned
            if bad and self.phase == "propose":
                raise ValueError("poisoned row in propose")
            token = VOCAB + 5 if bad and self.phase == "verify" else row.token_ids[-1]  # no such token
            drafts.append(DraftRow([token] * row.num_tokens))
        return Draft(drafts)

    def commit(self, rows):
        if self.phase == "commit" and any(row.slot in self.poisoned for row in rows):
            raise ValueError("poisoned row in commit")

    def release(self, slot):
        self.poisoned.discard(slot)


@pytest.fixture(scope="module")
def fail_method():
    register_method(MethodSpec("toy_fail", FailOptions, build=lambda ctx: FailingProposer(PHASE["now"])))
    yield
    unregister_method("toy_fail")


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("phase", ["prefill", "propose", "verify", "commit"])
def test_a_failing_row_fails_alone(fail_method, tiny_pair, references, phase, step):
    PHASE["now"] = phase
    target, draft = tiny_pair
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, step=step, speculation_length=SpeculationLengthPolicy()),
                       target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft))
    prompts = ragged_prompts(8)
    poisoned = POISON + [1, 2, 3]
    assert all(p[: len(POISON)] != POISON for p in prompts)
    toy = SpeculationParams(method="toy_fail", num_speculative_tokens=3)
    specs = [toy if i % 2 else SpeculationParams(method="draft", num_speculative_tokens=3) for i in range(8)]
    outs = engine.generate(prompts[:2] + [poisoned] + prompts[2:], GREEDY, specs[:2] + [toy] + specs[2:])
    bad = outs.pop(2)
    assert bad.finished and bad.finish_reason == "error"
    expected = "IndexError" if phase == "verify" else f"poisoned .* in {phase}"
    assert bad.error and pytest.importorskip("re").search(expected, bad.error), bad.error
    assert [o.token_ids for o in outs] == references  # the same batches, untouched
    assert all(o.finish_reason == "length" for o in outs)
    # The engine goes on serving, its slots all free again.
    assert sorted(engine.scheduler.free_slots) == [0, 1, 2, 3]
    again = engine.generate(prompts[:2], GREEDY, toy)
    assert [o.token_ids for o in again] == references[:2]
