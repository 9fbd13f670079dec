"""Overlapped drafting (separate layout): the draft worker drafts the next step while the
target verifies; output is token-identical greedy and exact in distribution when sampling."""

import time

import numpy as np
import pytest
import ray

from specray.actors.coordinator import Coordinator
from specray.actors.engine_worker import overlaps_by_default
from tests.conftest import hf_greedy, tiny_llama
from tests.serving import workers_up
from tests.test_actors import PROMPTS, shutdown

GREEDY = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}


def run_mixed(coordinator) -> tuple[list, list]:
    """Ragged prompts joining a running batch, mixed methods, one abort mid-way."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [20 + i] for i in range(7)]
    methods = ["draft", "draft", "ngram", "none", "draft", "draft", "ngram"]
    refs = []
    for i, (p, m) in enumerate(zip(prompts, methods)):
        refs.append(coordinator.generate.remote([p], GREEDY, {"method": m, "num_speculative_tokens": 2 + i % 3}))
        time.sleep(0.03 * i)
    doomed = coordinator.stream.remote(PROMPTS[0], {**GREEDY, "max_tokens": 200}, {"method": "draft"})
    ray.get(next(doomed))
    del doomed  # the consumer goes away: the request is aborted
    return prompts, [ray.get(r)[0]["token_ids"] for r in refs]


@pytest.mark.parametrize("draft", ["tiny", "target"], ids=["weak draft", "perfect draft"])
def test_overlap_keeps_greedy_output(ray_session, tiny_tok, tiny_pair, char_tokenizer, draft):
    """A weak draft: the bonus guesses mostly fail (drafts made afresh); the target as its own
    draft: they always come true (drafts made during verification). Constrained rows too: a
    draft made ahead is checked against its row's grammar like any other."""
    from tests.test_structured import constrained_outputs_match

    ckpt = {**tiny_tok, "draft": tiny_tok["target"]} if draft == "target" else tiny_tok
    c = workers_up(Coordinator.remote({**ckpt, "max_num_seqs": 3, "overlap_drafting": True}))
    try:
        prompts, outs = run_mixed(c)
        assert outs == [hf_greedy(tiny_pair[0], p, GREEDY["max_tokens"]) for p in prompts]
        constrained_outputs_match(c, tiny_pair[0], char_tokenizer, ["draft"])
        stats = ray.get(ray.get(c.workers.remote())["target"].overlap_stats.remote())["draft"]
        assert stats["rows"] > 0
        if draft == "target":  # most steps took a draft made during the previous verification
            assert stats["hits"] > stats["rows"] / 2, stats
    finally:
        shutdown(c)


def test_overlap_is_off_by_default_on_the_cpu(tiny_coordinator, tiny_pair):
    """Unset, overlapped drafting follows the device: these workers run on the CPU, where the
    ahead forward would compete with the verification for the same cores; output is the same."""
    prompts, outs = run_mixed(tiny_coordinator)
    assert outs == [hf_greedy(tiny_pair[0], p, GREEDY["max_tokens"]) for p in prompts]
    stats = ray.get(ray.get(tiny_coordinator.workers.remote())["target"].overlap_stats.remote())["draft"]
    assert stats["overlap"] is False and stats["rows"] > 0 and stats["hits"] == 0, stats
    assert overlaps_by_default("cuda") and not overlaps_by_default("cpu")


def test_overlap_keeps_the_sampling_distribution(ray_session, tmp_path):
    from tests.test_sampling_e2e import NEW, PARAMS, PROMPT, VOCAB, check, exact_joint

    n = 2000
    target = tiny_llama(vocab=VOCAB, seed=3, init=0.25)
    target.save_pretrained(tmp_path / "t")
    # The target drafts for itself: the bonus guesses come true often, so both paths run.
    c = workers_up(Coordinator.remote({"target": str(tmp_path / "t"), "draft": str(tmp_path / "t"),
                                       "max_num_seqs": 64, "overlap_drafting": True}))
    try:
        # Longer than the 4 tokens checked, so that steps within them take drafts made ahead (the
        # prefill emits token 1; k = 1: a step emits up to 2, so tokens 4-5 come from the second
        # step, drafted during the first one's verification); the first 4 tokens' joint
        # distribution is still the target's.
        params = [{**PARAMS, "max_tokens": 6, "seed": i} for i in range(n)]
        outs = ray.get(c.generate.remote([PROMPT] * n, params, {"method": "draft", "num_speculative_tokens": 1}))
        stats = ray.get(ray.get(c.workers.remote())["target"].overlap_stats.remote())["draft"]
    finally:
        shutdown(c)
    assert 0 < stats["hits"] < stats["rows"], stats
    seqs = np.array([o["token_ids"][:NEW] for o in outs])
    assert seqs.shape == (n, NEW)
    assert min(check(seqs, exact_joint(target))) > 1e-3
