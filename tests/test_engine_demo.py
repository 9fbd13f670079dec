"""The engine on the trained demo pair: lossless greedy over 50 held-out prompts.

The references are HF ``generate(do_sample=False)`` of the target alone, one prompt at
a time. Every method must reproduce them token for token, alone and in batches where
prompts of different lengths join as others finish.
"""

import pytest

from specray.engine.params import SamplingParams, SpeculationParams
from tests.conftest import hf_greedy

pytestmark = pytest.mark.slow

NUM_PROMPTS, NEW = 50, 32
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(demo_pair):
    from specray.demo import held_out_prompts

    return held_out_prompts(NUM_PROMPTS, demo_pair.tokenizer, min_tokens=16, max_tokens=200)


@pytest.fixture(scope="module")
def prompt_ids(prompts, demo_models):
    tok = demo_models[2]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    assert len({len(i) for i in ids}) > 10  # a real mix of lengths
    return ids


@pytest.fixture(scope="module")
def references(demo_models, prompt_ids):
    target = demo_models[0]
    return [hf_greedy(target, ids, NEW) for ids in prompt_ids]


@pytest.mark.parametrize("batch", [1, 6])
@pytest.mark.parametrize(
    "spec",
    [
        SpeculationParams(method="none"),
        SpeculationParams(method="draft", num_speculative_tokens=3),
        SpeculationParams(method="ngram", num_speculative_tokens=4),
    ],
    ids=["none", "draft", "ngram"],
)
def test_greedy_matches_hf_generate(demo_engine, prompt_ids, references, spec, batch):
    engine = demo_engine(max_num_seqs=batch)
    outs = engine.generate(prompt_ids, GREEDY, spec)
    mismatched = [i for i, (o, r) in enumerate(zip(outs, references)) if o.token_ids != r]
    assert not mismatched, f"{len(mismatched)} of {len(outs)} prompts differ: {mismatched[:5]}"
    if spec.method == "draft":  # the trained draft really helps
        assert engine.totals.mean_accepted_length > 1.8


def test_text_prompts_and_stop_strings(demo_engine, prompts, references, demo_models):
    tok = demo_models[2]
    engine = demo_engine()
    full = engine.generate([prompts[0]], GREEDY, SpeculationParams(method="draft"))[0]
    assert full.text == tok.decode(references[0], skip_special_tokens=True)
    # Stop at a string that first appears mid-way through the greedy text.
    text = full.text
    stop = next(text[i : i + 3] for i in range(len(text) // 3, len(text) - 3) if text[i : i + 3].strip())
    cut = text.index(stop)
    for method in ["none", "draft", "ngram"]:
        out = engine.generate([prompts[0]], GREEDY.model_copy(update={"stop": [stop]}), SpeculationParams(method=method))[0]
        assert out.text == text[:cut] and out.finish_reason == "stop", method
        # The kept tokens are the fewest whose text reaches the stop string.
        assert out.token_ids == references[0][: len(out.token_ids)]
        assert stop in tok.decode(out.token_ids, skip_special_tokens=True)
        assert stop not in tok.decode(out.token_ids[:-1], skip_special_tokens=True)
