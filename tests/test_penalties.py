"""Penalties, min_tokens, logit bias, allowed tokens and min-p stay lossless under speculation.

They change the target's distribution, and at every verified node the change depends on the
tokens before *that node* (``engine/logits.py``). Greedy: every method's output equals plain
decoding with the same parameters, which equals an independent loop over the model here (and
HF ``generate`` for the repetition penalty), under the eager host step and the fixed-shape
device step; a step that forgot the path's tokens is caught. Sampled: the output distribution
equals the exact one, by chi-square (``tests/test_sampling_e2e.py``'s test), for a chain on
the host and a tree on the device.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import tiny_llama
from tests.test_engine import ragged_prompts

PENALTIES = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4)
METHODS = {  # name -> speculation (drafters that often agree with the target, so paths get long)
    "none": {"method": "none"},
    "draft": {"method": "draft", "num_speculative_tokens": 4},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "eagle": {"method": "eagle"},
    "eagle-2": {"method": "eagle", "dynamic_tree": True, "top_k": 3, "depth": 4, "total_tokens": 10},
    "medusa": {"method": "medusa"},
    "lookahead": {"method": "lookahead", "window_size": 3, "ngram_size": 3, "verification_set_size": 3},
}


def engine(target, step: str, max_num_seqs: int = 4) -> LLMEngine:
    """The target drafts for itself (as the draft model and through an EAGLE head that copies its
    last layer): drafts agree with the unprocessed target, so processing decides acceptance."""
    from tests.test_eagle import self_head
    from tests.test_medusa import random_heads

    return LLMEngine(
        EngineConfig(target="x", max_num_seqs=max_num_seqs, step=step, speculation_length=SpeculationLengthPolicy()),
        target_model=copy.deepcopy(target), draft_model=copy.deepcopy(target),
        medusa_heads=random_heads(vocab=target.config.vocab_size), resources={"eagle": self_head(target)},
    )


def reference(target, prompt: list[int], params: SamplingParams, stop_ids=frozenset()) -> list[int]:
    """Plain greedy decoding with the processing written out again, one token at a time."""
    s, out = params, []
    while len(out) < s.max_tokens:
        with torch.no_grad():
            x = target(torch.tensor([prompt + out])).logits[0, -1].double()
        if s.allowed_token_ids is not None:
            x = torch.where(torch.isin(torch.arange(len(x)), torch.tensor(s.allowed_token_ids)), x, -torch.inf)
        for t, b in (s.logit_bias or {}).items():
            x[t] += b
        if len(out) < s.min_tokens:
            x[list(stop_ids)] = -torch.inf
        counts = Counter(out)
        for t in set(prompt) | set(out):
            x[t] = x[t] / s.repetition_penalty if x[t] > 0 else x[t] * s.repetition_penalty
        for t, c in counts.items():
            x[t] -= s.frequency_penalty * c + s.presence_penalty
        out.append(int(x.argmax()))
        if out[-1] in stop_ids:
            break
    return out


@pytest.fixture(scope="module")
def target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(4, seed=5)


@pytest.fixture(scope="module")
def expected(target, prompts):
    params = SamplingParams(max_tokens=20, temperature=0, **PENALTIES)
    refs = [reference(target, p, params) for p in prompts]
    plain = [reference(target, p, SamplingParams(max_tokens=20, temperature=0)) for p in prompts]
    assert refs != plain  # the penalties change these outputs
    return params, refs


@pytest.mark.parametrize("step", ["eager", "static"])
def test_greedy_with_penalties_equals_plain_decoding_for_every_method(target, prompts, expected, step):
    params, refs = expected
    eng = engine(target, step)
    for name, spec in METHODS.items():
        outs = eng.generate(prompts, params, SpeculationParams(**spec))
        assert [o.token_ids for o in outs] == refs, name
        if name in ("draft", "eagle"):  # drafts were accepted and rejected: paths of every length ran
            accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
            assert 0 < accepted < sum(o.metrics["num_draft_tokens"] for o in outs), name


def test_a_step_that_forgets_the_path_is_caught(target, prompts, expected, monkeypatch):
    """Process every node with the committed tokens alone (the path's own tokens dropped): the
    drafts' outputs diverge from plain decoding. The test above would see that bug."""
    import specray.engine.logits as LP

    params, refs = expected
    monkeypatch.setattr(LP, "path_counts", lambda tokens, anc, vocab: torch.zeros(*tokens.shape, vocab))
    outs = engine(target, "eager").generate(prompts, params, SpeculationParams(**METHODS["draft"]))
    assert [o.token_ids for o in outs] != refs


def test_repetition_penalty_equals_hf_generate(target, prompts):
    params = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3)
    eng = engine(target, "eager")
    outs = eng.generate(prompts, params, SpeculationParams(**METHODS["draft"]))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            hf = target.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
        assert o.token_ids == hf[0, len(p):].tolist()


@pytest.mark.parametrize("step", ["eager", "static"])
def test_min_tokens_bias_and_allowed_tokens(target, prompts, step):
    """The first greedy token of each prompt made a stop token: plain decoding stops at once;
    with min_tokens it is held back for min_tokens tokens; logit bias and allowed tokens steer
    every method alike."""
    eng = engine(target, step)
    for p in prompts[:2]:
        stop = reference(target, p, SamplingParams(max_tokens=1, temperature=0))[0]
        cases = [
            SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop], min_tokens=6),
            SamplingParams(max_tokens=16, temperature=0, logit_bias={stop: -100.0, 3: 2.5}),
            SamplingParams(max_tokens=16, temperature=0, allowed_token_ids=[stop, 1, 2, 3, 9], **PENALTIES),
        ]
        for params in cases:
            ref = reference(target, p, params, frozenset(params.stop_token_ids))
            for name in ("none", "draft", "eagle", "ngram"):
                (out,) = eng.generate([p], params, SpeculationParams(**METHODS[name]))
                assert out.token_ids == ref, (name, params)
        held = reference(target, p, cases[0], frozenset([stop]))
        assert len(held) > 6 and stop not in held[:6]


def test_penalised_rows_read_once_per_step_too(target, prompts):
    from specray.bench.probes import host_reads

    eng = engine(target, "static")
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=12, temperature=0.8 if i % 2 else 0, seed=i, ignore_eos=True,
                                min_tokens=4, logit_bias={1: 1.0}, **PENALTIES)
        # (sampled EAGLE rows read their draws back per parent: README; greedy ones grow on the device)
        eng.add_request(p, params, SpeculationParams(**METHODS[["eagle", "draft", "none", "ngram"][i]]))
    eng.step()  # admits everyone
    reads = []
    while eng.has_unfinished():
        with host_reads() as counts:
            eng.step()
        reads.append(counts["reads"])
    assert len(reads) >= 3 and max(reads) == 1, reads


# -- sampled: the exact distribution ------------------------------------------------------
SAMPLED = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.7, logit_bias={5: 1.0}, min_p=0.05)
SAMPLES = 1500  # half test_sampling_e2e's: the processing moves the distribution far (the power check's p ~ 0)


NEUTRAL = dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}, min_p=0.0)


def exact_processed_joint(target, s: dict) -> np.ndarray:
    """P(t1..t4) [V, V, V, V] under the processing ``s`` and test_sampling_e2e's sampling, by
    enumeration; the processing written out in numpy (independent of specray's kernels)."""
    from tests import test_sampling_e2e as E

    v, prompt = E.VOCAB, E.PROMPT
    prefixes = list(itertools.product(range(v), repeat=E.NEW - 1))  # [V^3] of (t1, t2, t3)
    ids = torch.tensor([prompt + list(p) for p in prefixes])
    with torch.no_grad():
        logits = target(ids).logits[:, len(prompt) - 1:].double().numpy()  # [V^3, 4, V]
    probs = np.zeros_like(logits)
    for row, prefix in enumerate(prefixes):
        for j in range(E.NEW):
            out = list(prefix[:j])
            x = logits[row, j].copy()
            for t, b in s["logit_bias"].items():
                x[t] += b
            seen = sorted(set(prompt) | set(out))
            x[seen] = np.where(x[seen] > 0, x[seen] / s["repetition_penalty"], x[seen] * s["repetition_penalty"])
            for t, c in Counter(out).items():
                x[t] -= s["frequency_penalty"] * c + s["presence_penalty"]
            x = x / E.PARAMS["temperature"]
            p = np.exp(x - x.max())
            p[p < s["min_p"]] = 0.0  # p / p_max < min_p
            order = np.argsort(-p, kind="stable")
            keep = np.zeros(v, dtype=bool)
            keep[order[: E.PARAMS["top_k"]]] = True
            p = np.where(keep | (p >= p[order[E.PARAMS["top_k"] - 1]]), p, 0.0)
            p = p / p.sum()
            sorted_p = p[order]
            before = np.cumsum(sorted_p) - sorted_p
            drop = before >= E.PARAMS["top_p"]
            drop[0] = False
            p[order[drop]] = 0.0
            probs[row, j] = p / p.sum()
    grid = probs.reshape(v, v, v, E.NEW, v)
    return (grid[0, 0, 0, 0][:, None, None, None] * grid[:, 0, 0, 1][:, :, None, None]
            * grid[:, :, 0, 2][:, :, :, None] * grid[:, :, :, 3])


@pytest.fixture(scope="module")
def sampled_models():
    from tests import test_sampling_e2e as E

    return tiny_llama(vocab=E.VOCAB, seed=3, init=0.25), tiny_llama(vocab=E.VOCAB, layers=1, seed=4, init=0.25)


@pytest.mark.parametrize("step, method", [("eager", "draft"), ("static", "medusa")],
                         ids=["chain on the host", "tree on the device"])
def test_sampled_with_penalties_keeps_the_exact_distribution(sampled_models, step, method):
    from tests import test_sampling_e2e as E
    from tests.test_medusa import random_heads

    target, draft = sampled_models
    eng = LLMEngine(
        EngineConfig(target="x", max_num_seqs=64, step=step, speculation_length=SpeculationLengthPolicy()),
        target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft), medusa_heads=random_heads(vocab=E.VOCAB),
    )
    params = [SamplingParams(seed=i, **E.PARAMS, **SAMPLED) for i in range(SAMPLES)]
    spec = SpeculationParams(method=method, num_speculative_tokens=3) if method == "draft" else \
        SpeculationParams(method=method)
    seqs = np.array([o.token_ids for o in eng.generate([E.PROMPT] * SAMPLES, params, spec)])
    t = eng.totals
    assert t.num_drafts > SAMPLES // 2 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    assert min(E.check(seqs, exact_processed_joint(target, SAMPLED))) > 1e-3
    assert min(E.check(seqs, exact_processed_joint(target, NEUTRAL))) < 1e-6  # the processing shows: the check has power
