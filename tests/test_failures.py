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


def test_failing_a_request_from_outside_ends_its_stream_with_an_error_delta(make_engine):
    """What an engine worker does when a whole step raises: every request in flight ends with
    a last delta carrying 'error' and the message (HTTP 500), not a lost-worker error, and the
    engine serves on."""
    engine = make_engine()
    rids = [engine.add_request(p, GREEDY) for p in ragged_prompts(2)]
    engine.step()
    deltas = [engine.fail(rid, "internal error: RuntimeError: boom") for rid in engine.request_ids()]
    assert sorted(d.request_id for d in deltas) == sorted(rids)
    for d in deltas:
        assert d.finished and d.finish_reason == "error" and d.error == "internal error: RuntimeError: boom"
        assert d.new_token_ids == [] and d.metrics is not None
    assert not engine.has_unfinished() and engine.fail(rids[0], "again") is None
    assert len(engine.generate(ragged_prompts(1), GREEDY)[0].token_ids) == GREEDY.max_tokens
