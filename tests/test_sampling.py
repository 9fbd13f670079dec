"""probs_from_logits and sample: hand-made filters, mixed-parameter batches, seeding."""

import math

import pytest
import torch

from specray.kernels.sampling import probs_from_logits, sample, sample_from_uniform, uniforms


def _softmax(xs):
    e = [math.exp(x) for x in xs]
    return [v / sum(e) for v in e]


def _params(n, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.long),
        torch.full((n,), top_p),
    )


LOGITS = [2.0, 1.0, 0.0, -1.0, 3.0]  # sorted: idx 4, 0, 1, 2, 3


def test_temperature_only():
    probs = probs_from_logits(torch.tensor([LOGITS]), *_params(1, temperature=2.0))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs[0], torch.tensor(_softmax([x / 2 for x in LOGITS])))


def test_top_k_keeps_k_largest():
    probs = probs_from_logits(torch.tensor([LOGITS]), *_params(1, top_k=2))
    expected = _softmax([3.0, 2.0])
    torch.testing.assert_close(probs[0], torch.tensor([expected[1], 0, 0, 0, expected[0]]))


def test_top_p_smallest_set_reaching_mass():
    full = _softmax(LOGITS)  # ~[.237, .087, .032, .012, .644]
    # 0.644 < 0.7 <= 0.644 + 0.237: keep tokens 4 and 0.
    probs = probs_from_logits(torch.tensor([LOGITS]), *_params(1, top_p=0.7))
    kept = full[4] + full[0]
    torch.testing.assert_close(probs[0], torch.tensor([full[0] / kept, 0, 0, 0, full[4] / kept]))
    # A tiny top_p still keeps the most likely token.
    probs = probs_from_logits(torch.tensor([LOGITS]), *_params(1, top_p=1e-6))
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0, 0, 0, 1]))


def test_order_is_temperature_then_top_k_then_top_p():
    # T=2, top-k=3 keeps idx 4, 0, 1; top-p is applied to the renormalized top-3.
    top3 = _softmax([3.0 / 2, 2.0 / 2, 1.0 / 2])  # ~[.506, .307, .186]
    probs = probs_from_logits(torch.tensor([LOGITS]), torch.tensor([2.0]), torch.tensor([3]), torch.tensor([0.8]))
    kept = top3[0] + top3[1]
    torch.testing.assert_close(probs[0], torch.tensor([top3[1] / kept, 0, 0, 0, top3[0] / kept]))


def test_rows_with_different_params_match_single_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    temperature = torch.tensor([0.5, 1.0, 1.5, 0.8])
    top_k = torch.tensor([0, 5, 0, 10])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.9])
    batch = probs_from_logits(logits, temperature, top_k, top_p)
    for r in range(4):
        single = probs_from_logits(logits[r : r + 1], temperature[r : r + 1], top_k[r : r + 1], top_p[r : r + 1])
        torch.testing.assert_close(batch[r], single[0])
    assert (batch[1] > 0).sum() == 5
    assert (batch[3] > 0).sum() <= 10
    torch.testing.assert_close(batch.sum(-1), torch.ones(4))


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)]
)
def test_bad_params_raise(kwargs):
    with pytest.raises(ValueError):
        probs_from_logits(torch.zeros(1, 3), *_params(1, **kwargs))


def test_sample_seeded_determinism_and_independence_from_batch():
    probs = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(1)), -1)

    def run(seed_shared):
        g = torch.Generator().manual_seed(seed_shared)
        return [sample(probs, [g, g, None]) for _ in range(5)]

    a, b = run(7), run(7)
    for x, y in zip(a, b):
        assert x[:2].tolist() == y[:2].tolist()
    # A row with its own generator draws the same whatever the batch around it.
    alone = sample(probs[1:2], [torch.Generator().manual_seed(3)])
    in_batch = sample(probs, [None, torch.Generator().manual_seed(3), None])
    assert alone.item() == in_batch[1].item()


def test_sample_never_picks_zero_probability_and_follows_distribution():
    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    g = torch.Generator().manual_seed(0)
    draws = sample(p.expand(20000, 4), [g] * 20000)
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert freq[1] == 0
    torch.testing.assert_close(freq, p, atol=0.02, rtol=0)


def test_sample_from_uniform_edges():
    w = torch.tensor([[0.0, 2.0, 0.0, 2.0, 0.0]])
    assert sample_from_uniform(w, torch.tensor([0.0])).item() == 1
    assert sample_from_uniform(w, torch.tensor([0.4999])).item() == 1
    assert sample_from_uniform(w, torch.tensor([0.5])).item() == 3
    assert sample_from_uniform(w, torch.tensor([1.0 - 1e-9])).item() == 3


def test_uniforms_layout():
    g = torch.Generator().manual_seed(0)
    u = uniforms([2, 0, 3], [g, None, g], "cpu")
    assert u.shape == (3, 3)
    assert u[0, 2] == 0 and (u[1] == 0).all()
    expected = torch.rand(5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(torch.cat([u[0, :2], u[2]]), expected)
