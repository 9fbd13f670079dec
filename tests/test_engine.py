"""LLMEngine on tiny random models: lossless greedy, continuous batching, stops, errors."""

import pytest
import torch

from specray.engine.params import SamplingParams, SpeculationParams

METHODS = ["none", "draft", "ngram"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def ragged_prompts(n: int, seed: int = 0, vocab: int = 64):
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = 2 + (7 * i) % 19
        base = torch.randint(0, vocab, (length,), generator=g).tolist()
        prompts.append(base + base[: length // 2])  # repeats give prompt lookup something to match
    return prompts


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_hf_generate_batched(make_engine, references, method, k):
    engine = make_engine(max_num_seqs=4)  # 8 prompts through 4 slots: requests join mid-way
    outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method=method, num_speculative_tokens=k))
    assert [o.token_ids for o in outs] == references


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_hf_generate_batch_1(make_engine, references, method):
    engine = make_engine(max_num_seqs=1)
    outs = engine.generate(ragged_prompts(3), GREEDY, SpeculationParams(method=method))
    assert [o.token_ids for o in outs] == references[:3]


def test_self_draft_accepts_everything(tiny_pair, references):
    import copy

    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine

    target, _ = tiny_pair
    engine = LLMEngine(EngineConfig(target="x"), target_model=copy.deepcopy(target), draft_model=copy.deepcopy(target))
    out = engine.generate([ragged_prompts(1)[0]], GREEDY, SpeculationParams(method="draft", num_speculative_tokens=4))[0]
    assert out.token_ids == references[0]
    m = out.metrics
    assert m["num_accepted_tokens"] == m["num_draft_tokens"] > 0
    # 1 prefill + ceil(23 / 5) verification passes for 24 tokens.
    assert m["target_forward_passes"] == 1 + 5
    assert m["mean_accepted_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    assert m["accepted_per_pos"][0] == m["num_drafts"]


def test_mixed_methods_and_joins_between_steps(make_engine, references):
    """Requests with different methods share a batch and arrive at different steps."""
    engine = make_engine(max_num_seqs=3)
    prompts = ragged_prompts(8)
    pending = list(enumerate(prompts))
    ids, done = {}, {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 2 == 0:  # one new request every other step
            i, p = pending.pop(0)
            spec = SpeculationParams(method=METHODS[i % 3], num_speculative_tokens=1 + i % 4)
            ids[engine.add_request(p, GREEDY, spec)] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
        step += 1
    assert [done[i] for i in range(8)] == references


def test_streamed_deltas_add_up(make_engine, references):
    engine = make_engine()
    rid = engine.add_request(ragged_prompts(1)[0], GREEDY, SpeculationParams(method="draft", num_speculative_tokens=3))
    streamed = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            streamed += out.new_token_ids
    assert streamed == references[0]


def test_abort_frees_the_slot_and_leaves_others_alone(make_engine, references):
    engine = make_engine(max_num_seqs=2)
    prompts = ragged_prompts(3)
    a = engine.add_request(prompts[0], GREEDY, SpeculationParams(method="draft"))
    b = engine.add_request(prompts[1], GREEDY, SpeculationParams(method="ngram"))
    engine.step()
    engine.step()
    aborted = engine.abort(a)
    assert aborted.finished and aborted.finish_reason == "abort"
    c = engine.add_request(prompts[2], GREEDY, SpeculationParams(method="draft"))  # takes a's slot
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done[b] == references[1] and done[c] == references[2]
    assert engine.abort("no-such-request") is None


def test_stop_token_ids_and_max_tokens(make_engine, references):
    ref = references[0]
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    engine = make_engine()
    for method in METHODS:
        out = engine.generate(
            [ragged_prompts(1)[0]],
            SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_tok]),
            SpeculationParams(method=method, num_speculative_tokens=4),
        )[0]
        assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
        out = engine.generate(
            [ragged_prompts(1)[0]], SamplingParams(max_tokens=7, temperature=0), SpeculationParams(method=method)
        )[0]
        assert out.token_ids == ref[:7] and out.finish_reason == "length"


def test_context_limit_finishes_with_length(make_engine, references):
    engine = make_engine(max_model_len=20)
    prompt = ragged_prompts(2)[1]  # 9 + 4 = 13 tokens
    out = engine.generate([prompt], GREEDY, SpeculationParams(method="draft", num_speculative_tokens=5))[0]
    assert len(prompt) + len(out.token_ids) == 20
    assert out.token_ids == references[1][: 20 - len(prompt)] and out.finish_reason == "length"


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_is_reproducible_and_batch_independent(make_engine, method):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    spec = SpeculationParams(method=method, num_speculative_tokens=3)
    prompts = ragged_prompts(4)
    alone = make_engine().generate([prompts[0]], params, spec)[0].token_ids
    batched = make_engine().generate(prompts, params, spec)[0].token_ids
    assert alone == batched
    other = make_engine().generate([prompts[0]], params.model_copy(update={"seed": 99}), spec)[0].token_ids
    assert other != alone


def test_a_seeded_request_drafts_its_methods_default_length(make_engine):
    """A seed's text must not depend on what the self-tuning length measured: a seeded sampled
    request runs as if it gave the method's default k."""
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=7)
    prompts = ragged_prompts(3)
    default = SpeculationParams(method="draft")
    explicit = SpeculationParams(method="draft", num_speculative_tokens=default.num_speculative_tokens)
    engine = make_engine()
    for prompt in prompts:  # the controller learns (and may change its k) between these
        engine.generate([prompt], params.model_copy(update={"temperature": 0}), default)
    tuned = engine.generate(prompts, params, default)
    assert [o.token_ids for o in tuned] == [o.token_ids for o in make_engine().generate(prompts, params, explicit)]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": -1}, {"max_tokens": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -0.1}, {"top_k": -2},
     {"stop": [""]}, {"bogus": 1}],
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [{"num_speculative_tokens": 0}, {"num_speculative_tokens": -3},
                                    {"max_matching_ngram_size": 0}])
def test_bad_speculation_params_raise(kwargs):
    with pytest.raises(ValueError):
        SpeculationParams(**kwargs)


def test_bad_requests_raise_and_engine_keeps_working(make_engine, references):
    engine = make_engine(max_model_len=32)
    with pytest.raises(ValueError, match="unknown speculation method 'medusa2'"):
        engine.add_request([1, 2, 3], GREEDY, SpeculationParams(method="medusa2"))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(list(range(40)), GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        engine.add_request([1, 64], GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text without a tokenizer", GREEDY)
    no_draft = make_engine(draft=False)
    with pytest.raises(ValueError, match="draft model"):
        no_draft.add_request([1, 2], GREEDY, SpeculationParams(method="draft"))
    assert not engine.has_unfinished()
    out = engine.generate([ragged_prompts(1)[0]], GREEDY.model_copy(update={"max_tokens": 8}))[0]
    assert out.token_ids == references[0][:8]


def test_speculation_turns_off_above_a_batch_size(tiny_pair, references):
    import copy

    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine
    from specray.policies.spec_length import SpeculationLengthPolicy

    target, draft = tiny_pair
    engine = LLMEngine(
        EngineConfig(target="x", max_num_seqs=4, speculation_length=SpeculationLengthPolicy(disable_above_batch=2)),
        target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft),
    )
    spec = SpeculationParams(method="draft", num_speculative_tokens=3)
    busy = engine.generate(ragged_prompts(4), GREEDY, spec)  # 4 running > 2: plain decoding
    assert [o.token_ids for o in busy] == references[:4]
    assert all(o.metrics["num_drafts"] == 0 for o in busy)
    quiet = engine.generate(ragged_prompts(1), GREEDY, spec)[0]
    assert quiet.token_ids == references[0] and quiet.metrics["num_drafts"] > 0


def test_metrics_dict_has_every_field():
    """``SpecMetrics.to_dict`` spells its fields out (for speed): a field added later must be in it."""
    from dataclasses import fields

    from specray.engine.metrics import SpecMetrics

    m = SpecMetrics()
    m.record_draft(3, 2)
    d = m.to_dict()
    assert {f.name for f in fields(SpecMetrics)} <= set(d) and SpecMetrics.from_dict(d) == m


def test_step_delta_dict_is_the_dataclass_as_a_dict():
    """``StepDelta.to_dict`` copies the fields shallowly (for speed, once per row per step in
    the engine worker): the same dict ``asdict`` gives, every field set."""
    from dataclasses import asdict, fields

    from specray.engine.delta import StepDelta

    d = StepDelta("r", [5, 6], "ab", True, "stop", None, {"drafted": 4, "accepted": 1}, [{"5": -0.1}], [None],
                  {"num_drafts": 1}, 3)
    assert d.to_dict() == asdict(d) and set(d.to_dict()) == {f.name for f in fields(StepDelta)}
