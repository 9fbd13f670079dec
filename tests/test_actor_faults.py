"""Coordinators of their own: colocated mode, infeasible placement, worker loss."""

import time

import pytest
import ray

from specray.actors.coordinator import Coordinator, StartError
from tests.test_actors import GREEDY, PROMPTS, references, shutdown  # noqa: F401


def test_infeasible_placement_fails_fast(ray_session, tiny_checkpoints):
    """The placement check itself answers in seconds (actor start-up is not counted), as the
    coordinator's StartError naming the cause."""
    too_big = Coordinator.remote({**tiny_checkpoints, "placement": {"target": {"num_gpus": 3}}})
    # Fits the totals but not the topology: two bundles on different nodes of a 1-node cluster.
    spread = Coordinator.remote({**tiny_checkpoints, "placement": {"strategy": "STRICT_SPREAD", "timeout_s": 2}})
    ray.get([too_big.stats.remote(), spread.stats.remote()])  # both actors are up
    start = time.monotonic()
    with pytest.raises(StartError, match="needs 4 GPU"):
        ray.get(too_big.ready.remote())
    # Seconds on a quiet machine; the bound is loose enough for two shared cores under load and
    # still catches a placement left pending (it would never answer).
    assert time.monotonic() - start < 60
    start = time.monotonic()
    with pytest.raises(StartError, match="not ready after 2s"):
        ray.get(spread.ready.remote())
    assert time.monotonic() - start < 60
    shutdown(too_big)
    shutdown(spread)


def test_draft_loss_costs_only_speed(ray_session, tiny_checkpoints, references):
    c = Coordinator.remote({**tiny_checkpoints, "max_num_seqs": 4})
    ray.get(c.ready.remote())
    long = {**GREEDY, "max_tokens": 24}
    gen = c.stream.remote(PROMPTS[2], long, {"method": "draft", "num_speculative_tokens": 2})
    others = c.generate.remote(PROMPTS[:2], long, {"method": "draft", "num_speculative_tokens": 2})
    first = ray.get(next(gen))  # generation is under way
    draft = ray.get(c.workers.remote())["draft"]
    ray.kill(draft, no_restart=True)
    tokens = first["new_token_ids"] + sum((ray.get(r)["new_token_ids"] for r in gen), [])
    assert tokens == references[2]
    assert [o["token_ids"] for o in ray.get(others)] == references[:2]
    stats = ray.get(c.stats.remote())
    assert stats["restarts"]["draft"] >= 1
    # The replacement serves: speculation resumes for new requests.
    deadline = time.monotonic() + 60
    while True:
        out = ray.get(c.generate.remote([PROMPTS[3]], GREEDY, {"method": "draft"}))[0]
        assert out["token_ids"] == references[3]
        if out["metrics"]["num_drafts"] > 0 or time.monotonic() > deadline:
            break
    assert out["metrics"]["num_drafts"] > 0
    shutdown(c)


@pytest.mark.parametrize("mode", ["separate", "colocated"])
def test_engine_worker_loss_loses_no_request(ray_session, tiny_checkpoints, tiny_pair, mode):
    """Kill the worker holding the target during 9 concurrent streams (more than its slots):
    every request finishes, greedy outputs identical to an undisturbed run, streams unbroken,
    and a seeded sampled stream continues exactly from its generator state."""
    from tests.conftest import hf_greedy

    c = Coordinator.remote({**tiny_checkpoints, "max_num_seqs": 4, "placement": {"mode": mode}})
    ray.get(c.ready.remote())
    greedy = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompts = [PROMPTS[i % len(PROMPTS)] + [40 + i] for i in range(8)]
    methods = ["none", "draft", "ngram", "draft"]
    streams = [c.stream.remote(p, greedy, {"method": methods[i % 4], "num_speculative_tokens": 3})
               for i, p in enumerate(prompts)]
    sampled = {"max_tokens": 40, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    undisturbed = ray.get(c.generate.remote([prompts[0]], sampled, {"method": "none"}))[0]["token_ids"]
    seeded = c.stream.remote(prompts[0], sampled, {"method": "none"})
    firsts = [ray.get(next(s)) for s in streams + [seeded]]  # every stream is under way
    role = "target" if mode == "separate" else "engine"
    ray.kill(ray.get(c.workers.remote())[role], no_restart=True)
    results = []
    for first, s in zip(firsts, streams + [seeded]):
        outs = [first] + [ray.get(r) for r in s]
        assert outs[-1]["finished"] and outs[-1]["finish_reason"] == "length"
        tokens = sum((o["new_token_ids"] for o in outs), [])
        # Nothing repeated or skipped across the replay: the stream's tokens are those the engine counted.
        assert len(tokens) == outs[-1]["metrics"]["num_generated_tokens"]
        results.append(tokens)
    assert results[:-1] == [hf_greedy(tiny_pair[0], p, greedy["max_tokens"]) for p in prompts]
    assert results[-1] == undisturbed
    assert ray.get(c.stats.remote())["restarts"][role] == 1
    out = ray.get(c.generate.remote([PROMPTS[1]], GREEDY, {"method": "draft"}))[0]  # and it keeps serving
    assert out["token_ids"] == hf_greedy(tiny_pair[0], PROMPTS[1], GREEDY["max_tokens"])
    shutdown(c)


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
