"""Log-probabilities of emitted and prompt tokens (engine/logprobs.py), in process: equal to the
target's own (HF, teacher-forced) for every method, greedy and sampled, and for the prompt."""

import pytest
import torch

from specray.engine.params import SamplingParams, SpeculationParams

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]


def hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("spec", [{"method": "none"}, {"method": "draft", "num_speculative_tokens": 3},
                                  {"method": "ngram", "num_speculative_tokens": 4}])
def test_emitted_logprobs_are_the_targets(make_engine, target, temperature, spec):
    sampling = SamplingParams(max_tokens=20, temperature=temperature, seed=11, logprobs=4)
    out = make_engine().generate([PROMPT], sampling, SpeculationParams(**spec))[0]
    assert len(out.logprobs) == len(out.token_ids) == 20 and out.prompt_logprobs is None
    ref = hf_logprobs(target, PROMPT + out.token_ids)
    for j, (tok, e) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(PROMPT) - 1 + j]
        assert e["id"] == tok and abs(e["logprob"] - row[tok].item()) < 1e-4
        top = row.topk(4)
        assert [t for t, _ in e["top"]] == top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(e["top"], top.values.tolist())) < 1e-4


def test_prompt_logprobs_and_nothing_unasked(make_engine, target):
    engine = make_engine()
    asked, plain = engine.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=3, temperature=0, logprobs=0, prompt_logprobs=2),
        SamplingParams(max_tokens=3, temperature=0)])
    ref = hf_logprobs(target, PROMPT)
    assert asked.prompt_logprobs[0] is None and len(asked.prompt_logprobs) == len(PROMPT)
    for t in range(1, len(PROMPT)):
        e = asked.prompt_logprobs[t]
        assert e["id"] == PROMPT[t] and abs(e["logprob"] - ref[t - 1, PROMPT[t]].item()) < 1e-4
        assert [i for i, _ in e["top"]] == ref[t - 1].topk(2).indices.tolist()
    assert all(e["top"] == [] for e in asked.logprobs)  # logprobs=0: the token's own only
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert plain.token_ids == asked.token_ids


def test_the_fixed_shape_step_reports_the_same_logprobs(make_engine):
    """The device path (acceptance on the device, one read-back) scores tokens as the eager one."""
    sampling = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    spec = SpeculationParams(method="draft", num_speculative_tokens=3)
    eager = make_engine(step="eager").generate([PROMPT], sampling, spec)[0]
    static = make_engine(step="static").generate([PROMPT], sampling, spec)[0]
    assert static.token_ids == eager.token_ids
    for a, b in zip(static.logprobs, eager.logprobs):
        assert a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) < 1e-4
        assert [i for i, _ in a["top"]] == [i for i, _ in b["top"]]
