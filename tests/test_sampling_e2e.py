"""Speculative sampling keeps the target's distribution, end to end through the engine.

On a target with an 8-token vocabulary we enumerate every continuation to get the exact
distribution of the first four generated tokens (after temperature/top-k/top-p), then
sample thousands of seeded requests with and without speculation and test each
position's marginal, and the joint of the first two tokens, by chi-square. Positions 2-4
come from multi-token verification steps, so accepted, recovered and bonus tokens are
all exercised. A deliberately biased sampler is rejected by the same test.
"""

import copy
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.kernels.sampling import probs_from_logits
from tests.conftest import tiny_llama

VOCAB, NEW, N = 8, 4, 3000
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # repeats: prompt lookup proposes often
PARAMS = dict(max_tokens=NEW, temperature=0.9, top_k=6, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(vocab=VOCAB, seed=3, init=0.25), tiny_llama(vocab=VOCAB, layers=1, seed=4, init=0.25)


def exact_joint(target) -> np.ndarray:
    """P(t1..t4) as an array [V, V, V, V], by enumerating all prefixes."""
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW - 1)))  # [V^3, 3]
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, len(PROMPT) - 1 :]  # [V^3, 4, V]
    flat = logits.reshape(-1, VOCAB)
    n = flat.shape[0]
    probs = probs_from_logits(
        flat,
        torch.full((n,), PARAMS["temperature"]),
        torch.full((n,), PARAMS["top_k"]),
        torch.full((n,), PARAMS["top_p"]),
    ).reshape(len(prefixes), NEW, VOCAB).double()
    joint = np.ones((VOCAB,) * NEW)
    for combo in itertools.product(range(VOCAB), repeat=NEW):
        row = int(np.ravel_multi_index(combo[:-1], (VOCAB,) * (NEW - 1)))
        joint[combo] = float(np.prod([probs[row, j, combo[j]] for j in range(NEW)]))
    return joint


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit; bins expecting < 5 samples are pooled."""
    expected = probs.ravel() * counts.sum()
    counts = counts.ravel()
    small = expected < 5
    e = np.append(expected[~small], expected[small].sum())
    c = np.append(counts[~small], counts[small].sum())
    keep = e > 0
    return float(chisquare(c[keep], e[keep] * c[keep].sum() / e[keep].sum()).pvalue)


def samples(models, method: str) -> np.ndarray:
    target, draft = models
    engine = LLMEngine(
        EngineConfig(target="x", max_num_seqs=64),
        target_model=copy.deepcopy(target),
        draft_model=copy.deepcopy(draft),
    )
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params, SpeculationParams(method=method, num_speculative_tokens=3))
    if method != "none":  # the speculative path really ran, with rejections
        t = engine.totals
        assert t.num_drafts > N // 2 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    return np.array([o.token_ids for o in outs])


def check(seqs: np.ndarray, joint: np.ndarray) -> list[float]:
    pvals = []
    for pos in range(NEW):
        axes = tuple(a for a in range(NEW) if a != pos)
        counts = np.bincount(seqs[:, pos], minlength=VOCAB)
        pvals.append(chi2_pvalue(counts, joint.sum(axis=axes)))
    pair_counts = np.zeros((VOCAB, VOCAB))
    np.add.at(pair_counts, (seqs[:, 0], seqs[:, 1]), 1)
    pvals.append(chi2_pvalue(pair_counts, joint.sum(axis=(2, 3))))
    return pvals


def assert_follows(seqs: np.ndarray, target) -> None:
    """``seqs`` pass the chi-square checks against ``target``'s exact distribution, and the
    negative control — the same samples with 20% repeating their first token (a plausible bug:
    always taking the draft) — fails them."""
    joint = exact_joint(target)
    assert min(check(seqs, joint)) > 1e-3
    biased = seqs.copy()
    biased[: N // 5, 1:] = biased[: N // 5, :1]
    assert min(check(biased, joint)) < 1e-3


@pytest.fixture(scope="module")
def joint(models):
    return exact_joint(models[0])


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_speculative_sampling_matches_target_distribution(models, joint, method):
    pvals = check(samples(models, method), joint)
    assert min(pvals) > 1e-3, pvals


def test_the_check_has_power(models, joint):
    """Greedy-biased samples (a plausible bug: always taking the draft) must fail."""
    seqs = samples(models, "draft")
    biased = seqs.copy()
    biased[: N // 5, 1:] = biased[: N // 5, :1]  # 20% repeat their first token
    assert min(check(biased, joint)) < 1e-3


def test_sampling_under_the_verification_budget_matches_target_distribution(models, joint):
    """No seed and no length: the budget chooses every row's draft length every step (from past
    steps and its own draws, never from this step's tokens): rows draft and are cut, and the
    output still follows the target's distribution."""
    target, draft = models
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=64, profile_costs=False),
                       target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft))
    policy, chosen = engine.driver.length_policy, set()
    caps = policy.caps
    policy.caps = lambda rows, *args: (lambda c: (chosen.update(c), c)[1])(caps(rows, *args))
    torch.manual_seed(0)  # unseeded rows draw from torch's global generator
    outs = engine.generate([PROMPT] * N, SamplingParams(**PARAMS), SpeculationParams(method="draft"))
    assert len(chosen) >= 2 and max(chosen) > 0 and engine.totals.num_accepted_tokens > 0, chosen
    assert min(check(np.array([o.token_ids for o in outs]), joint)) > 1e-3
