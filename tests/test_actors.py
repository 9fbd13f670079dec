"""The Ray actor system through the session's coordinators (tests/serving.py): lossless greedy,
streams, concurrent arrivals, refused requests, and a failing row, in both layouts. Tests that
need a coordinator of their own (GPU and node placement, long streams, faults) are in
tests/test_actor_faults.py."""

import time

import pytest
import ray

from tests.conftest import hf_greedy

GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [5, 5, 6, 5, 5], [30, 31]]


@pytest.fixture(scope="module")
def references(tiny_pair):
    return [hf_greedy(tiny_pair[0], p, GREEDY["max_tokens"]) for p in PROMPTS]


def shutdown(coordinator) -> None:
    """Shut a coordinator down and wait until its placement group's GPUs are free again."""
    ray.get(coordinator.shutdown.remote())
    ray.kill(coordinator)
    deadline = time.monotonic() + 120
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources().get("GPU", 0):
        if time.monotonic() > deadline:
            raise TimeoutError("GPUs not released after killing the coordinator")
        time.sleep(0.1)


def test_concurrent_requests_arriving_at_different_times(tiny_coordinator, references):
    methods = ["none", "draft", "ngram", "draft", "ngram"]
    refs = []
    for i, (prompt, method) in enumerate(zip(PROMPTS, methods)):
        spec = {"method": method, "num_speculative_tokens": 1 + i % 4}
        refs.append(tiny_coordinator.generate.remote([prompt], GREEDY, spec))
        time.sleep(0.05 * i)  # later requests join a running batch
    outs = [ray.get(r)[0] for r in refs]
    assert [o["token_ids"] for o in outs] == references
    assert sum(o["metrics"]["num_drafts"] for o in outs) > 0


def test_stream_yields_incremental_tokens(tiny_coordinator, references):
    deltas = [ray.get(ref)["new_token_ids"]
              for ref in tiny_coordinator.stream.remote(PROMPTS[0], GREEDY, {"method": "draft"})]
    assert len(deltas) > 2 and sum(deltas, []) == references[0]


def test_bad_parameters_raise_value_error(tiny_coordinator):
    with pytest.raises(ValueError, match="unknown speculation method"):
        ray.get(tiny_coordinator.generate.remote([[1, 2]], GREEDY, {"method": "bogus"}))
    with pytest.raises(ValueError, match="max_tokens"):
        ray.get(tiny_coordinator.generate.remote([[1, 2]], {"max_tokens": -1}))


def test_a_request_list_with_one_bad_prompt_runs_none_of_it(tiny_coordinator):
    """Admitted whole or refused whole: every record is made before any is queued."""
    with pytest.raises(ValueError, match="prompt token ids"):
        ray.get(tiny_coordinator.generate.remote([[1, 2], [3, 4], [10**6]], GREEDY))
    assert ray.get(tiny_coordinator.stats.remote())["in_flight"] == 0
    assert ray.get(tiny_coordinator.generate.remote([[1, 2]], {**GREEDY, "max_tokens": 2}))[0]["token_ids"]


@pytest.mark.slow  # the session's coordinators (asked for by name, so not marked by their fixture)
@pytest.mark.parametrize("mode", ["separate", "colocated"])
def test_draft_model_and_medusa_through_the_coordinator(request, references, mode):
    """Both layouts, more prompts than slots: greedy output as plain decoding's for a draft
    model and for Medusa heads on the target."""
    c = request.getfixturevalue("tiny_coordinator" if mode == "separate" else "tiny_colocated_coordinator")
    for spec in ({"method": "draft", "num_speculative_tokens": 3}, {"method": "medusa", "tree": "trtllm_example"}):
        outs = ray.get(c.generate.remote(PROMPTS, GREEDY, spec))
        assert [o["token_ids"] for o in outs] == references, spec
        assert sum(o["metrics"]["num_drafts"] for o in outs) > 0, spec


@pytest.mark.slow  # the session's coordinators (asked for by name, so not marked by their fixture)
@pytest.mark.parametrize("mode, phase", [("colocated", "propose"), ("separate", "propose"), ("separate", "verify")])
def test_a_failing_row_fails_alone_behind_ray(request, references, mode, phase):
    """The toy method of tests/failing_method.py, registered in the session's coordinators and
    every worker they start by Ray's setup hook (in the separate layout it drafts in a worker of
    its own): the poisoned request finishes with 'error' and the message, the others in the
    same batches finish as plain greedy decoding would, and the coordinator goes on serving
    (the other tests that share it)."""
    import re

    from tests.failing_method import NAME, poisoned

    c = request.getfixturevalue("tiny_coordinator" if mode == "separate" else "tiny_colocated_coordinator")
    toy = {"method": NAME, "num_speculative_tokens": 3}
    draft = {"method": "draft", "num_speculative_tokens": 3}
    prompts = PROMPTS[:2] + [poisoned(phase)] + PROMPTS[2:4]
    specs = [toy, draft, toy, toy, draft]
    outs = ray.get(c.generate.remote(prompts, [GREEDY] * 5, specs))
    bad = outs.pop(2)
    assert bad["finished"] and bad["finish_reason"] == "error"
    expected = "IndexError" if phase == "verify" else "poisoned row in propose"
    assert bad["error"] and re.search(expected, bad["error"]), bad["error"]
    assert [o["token_ids"] for o in outs] == references[:4]
    assert all(o["finish_reason"] == "length" for o in outs)
    again = ray.get(c.generate.remote(PROMPTS[:2], GREEDY, toy))
    assert [o["token_ids"] for o in again] == references[:2]
