"""Failure containment: a row whose proposer or verification raises fails alone.

A toy method (``tests/failing_method.py``) raises for one poisoned request, in each phase
of a step (its prefill hook, its proposal, the target's verification of its draft, its
commit hook). That request
finishes with finish_reason 'error' and the message; every other request in the same
batches, of the same method or another, finishes exactly as plain greedy decoding would,
and the engine goes on serving new requests. Eager and fixed-shape steps alike.
"""

from __future__ import annotations

import copy

import pytest

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SpeculationParams
from specray.policies.registry import register_method, unregister_method
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.failing_method import NAME, POISON, spec
from tests.test_engine import GREEDY, ragged_prompts

PHASE = {"now": "propose"}


@pytest.fixture(scope="module")
def fail_method():
    register_method(spec(lambda: PHASE["now"]))
    yield
    unregister_method(NAME)


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
