"""greedy_accept and rejection_accept: hand-made cases, a naive reference, and
statistical checks that speculation reproduces the target distribution."""

import pytest
import torch
from scipy.stats import chisquare

from specray.kernels.acceptance import Acceptance, greedy_accept, rejection_accept
from specray.kernels.sampling import probs_from_logits

P_MIN = 1e-3  # chi-square p-value threshold (seeds are fixed, so results are deterministic)


def onehot(tokens, vocab):
    return torch.nn.functional.one_hot(torch.as_tensor(tokens), vocab).float()


# ---------------------------------------------------------------- hand-made cases


def test_greedy_perfect_match_emits_bonus():
    assert greedy_accept([[3, 1, 4]], [[3, 1, 4, 2]]) == ([3], [[3, 1, 4, 2]])


def test_greedy_early_mismatch_emits_recovered():
    assert greedy_accept([[3, 5, 4]], [[3, 1, 4, 2]]) == ([1], [[3, 1]])


def test_greedy_zero_length_and_ragged():
    best = [[3, 1, 4, 2], [5, 0, 0, 0], [2, 2, 3, 0]]
    assert greedy_accept([[3, 1], [], [2, 2]], best) == ([2, 0, 2], [[3, 1, 4], [5], [2, 2, 3]])
    assert greedy_accept([[], []], [[1], [4]]) == ([0, 0], [[1], [4]])


def test_greedy_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 5, 4  # small vocabulary so matches are common
    best = torch.randn(b, k + 1, v, generator=g).argmax(-1)
    # Drafts mostly equal to the argmax, with random corruptions.
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.8, best[:, :k], torch.randint(0, v, (b, k), generator=g))
    lengths = torch.randint(0, k + 1, (b,), generator=g)
    rows = [drafts[r, : int(lengths[r])].tolist() for r in range(b)]
    counts, emitted = greedy_accept(rows, best.tolist())
    for r in range(b):
        out = []
        for i in range(int(lengths[r])):
            if drafts[r, i] != best[r, i]:
                break
            out.append(int(drafts[r, i]))
        out.append(int(best[r, len(out)]))
        assert emitted[r] == out and counts[r] == len(out) - 1
    assert 0 < sum(counts) < int(lengths.sum())  # both outcomes occur


def test_rejection_certain_target_perfect_match_and_mismatch():
    target = onehot([[3, 1, 4, 2], [3, 1, 4, 2]], 6)
    drafts = torch.tensor([[3, 1, 4], [3, 0, 4]])
    for draft_probs in (None, onehot(drafts, 6)):
        acc = rejection_accept(drafts, torch.tensor([3, 3]), draft_probs, target, [None, None])
        assert acc.num_accepted.tolist() == [3, 1]
        assert acc.emitted(0) == [3, 1, 4, 2]  # bonus
        assert acc.emitted(1) == [3, 1]  # recovered


def test_rejection_zero_length_and_ragged():
    target = onehot([[3, 1, 4, 2], [5, 0, 0, 0], [2, 2, 3, 0]], 6)
    drafts = torch.tensor([[3, 1, 0], [1, 1, 1], [2, 2, 0]])
    acc = rejection_accept(drafts, torch.tensor([2, 0, 2]), None, target, [None] * 3)
    assert acc.num_accepted.tolist() == [2, 0, 2]
    assert [acc.emitted(r) for r in range(3)] == [[3, 1, 4], [5], [2, 2, 3]]
    assert isinstance(acc, Acceptance)


def test_rejection_degenerate_residual_falls_back_to_target():
    # The draft claims q(d) = 0 yet drafted d, and p(d) = 0: rejected, and
    # max(0, p - q) is all zero, so the token comes from p.
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    acc = rejection_accept(torch.tensor([[2]]), torch.tensor([1]), p[:, :1].clone(), p, [None])
    assert acc.num_accepted.item() == 0
    assert acc.emitted(0)[0] in (0, 1)


def test_rejection_row_result_independent_of_batch_and_seeded():
    g = torch.Generator().manual_seed(5)
    b, k, v = 4, 3, 8
    target = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    q = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    drafts = torch.randint(0, v, (b, k), generator=g)
    lengths = torch.tensor([3, 2, 0, 3])

    def gens():
        return [torch.Generator().manual_seed(100 + r) for r in range(b)]

    batch = rejection_accept(drafts, lengths, q, target, gens())
    again = rejection_accept(drafts, lengths, q, target, gens())
    alone = rejection_accept(drafts[1:2], lengths[1:2], q[1:2], target[1:2], [torch.Generator().manual_seed(101)])
    assert batch.tokens.equal(again.tokens) and batch.num_accepted.equal(again.num_accepted)
    assert alone.emitted(0) == batch.emitted(1)


def test_rejection_validates_inputs():
    target = torch.full((1, 3, 4), 0.25)
    with pytest.raises(ValueError):
        rejection_accept(torch.zeros(1, 2, dtype=torch.long), torch.tensor([3]), None, target, [None])
    with pytest.raises(ValueError):
        rejection_accept(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), None, target, [None, None])
    with pytest.raises(ValueError, match="need 3 target positions"):
        greedy_accept([[0, 0]], [[0, 0]])
    with pytest.raises(ValueError, match="1 draft rows but 2"):
        greedy_accept([[0]], [[0, 0], [0, 0]])


# ---------------------------------------------------------------- statistical checks

V = 6
ROWS = 20000


def _tables(seed, k):
    """Target and draft distributions that depend on the previous token.

    p[i]: [V, V] (row = previous token; p[0] ignores it), likewise q[i].
    """
    g = torch.Generator().manual_seed(seed)
    p = [torch.softmax(torch.randn(V, V, generator=g), -1) for _ in range(k + 1)]
    q = [torch.softmax(torch.randn(V, V, generator=g), -1) for _ in range(k)]
    p[0][:] = p[0][0]
    q[0][:] = q[0][0]
    return p, q


def _speculate(p, q, k, seed, one_hot_drafts=False, sampler=rejection_accept):
    """Draft ROWS chains from q, verify against p; return the Acceptance."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.zeros(ROWS, dtype=torch.long)
    drafts, qs, ps = [], [], []
    for i in range(k):
        qi = q[i][prev]  # [ROWS, V]
        d = torch.multinomial(qi, 1, generator=g).squeeze(1)
        ps.append(p[i][prev])
        qs.append(qi)
        drafts.append(d)
        prev = d
    ps.append(p[k][prev])
    target = torch.stack(ps, 1)  # [ROWS, K+1, V]
    draft_tokens = torch.stack(drafts, 1)  # [ROWS, K]
    draft_probs = None if one_hot_drafts else torch.stack(qs, 1)
    lengths = torch.full((ROWS,), k, dtype=torch.long)
    shared = torch.Generator().manual_seed(seed + 1)
    return sampler(draft_tokens, lengths, draft_probs, target, [shared] * ROWS)


def _chi2_pvalue(samples, probs):
    counts = torch.bincount(samples, minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the target's support"
    expected = probs[support].double() * counts.sum() / probs[support].double().sum()
    return chisquare(counts[support].numpy(), expected.numpy()).pvalue


def _check_lossless(p, acc):
    assert _chi2_pvalue(acc.tokens[:, 0], p[0][0]) > P_MIN
    # Second emitted token given the first: the target's distribution after it.
    has_second = acc.num_accepted >= 1
    for first in range(V):
        rows = has_second & (acc.tokens[:, 0] == first)
        if rows.sum() >= 500:
            assert _chi2_pvalue(acc.tokens[rows, 1], p[1][first]) > P_MIN


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_rejection_reproduces_target_distribution(k, one_hot_drafts):
    p, q = _tables(seed=k, k=k)
    _check_lossless(p, _speculate(p, q, k, seed=10 + k, one_hot_drafts=one_hot_drafts))


def test_rejection_lossless_with_temperature_processed_target():
    # Target after temperature and top-k (zeros outside the top 4); draft from
    # another distribution that puts mass where the target has none.
    k = 2
    g = torch.Generator().manual_seed(42)
    n = V
    logits = torch.randn(n, V, generator=g) * 2
    pt = probs_from_logits(logits, torch.full((n,), 0.7), torch.full((n,), 4), torch.full((n,), 1.0))
    p = [pt, pt, pt]
    p[0] = pt[0].expand(V, V)
    _, q = _tables(seed=43, k=k)
    acc = _speculate(p, q, k, seed=44)
    _check_lossless(p, acc)


def _accept_always(draft_tokens, draft_lengths, draft_probs, target_probs, generators):
    n = draft_lengths.clone()
    tokens = torch.cat([draft_tokens, target_probs[:, -1].argmax(-1, keepdim=True)], 1)
    return Acceptance(num_accepted=n, tokens=tokens)


def test_chi_square_has_power_against_accepting_always():
    p, q = _tables(seed=1, k=1)
    acc = _speculate(p, q, 1, seed=11, sampler=_accept_always)
    assert _chi2_pvalue(acc.tokens[:, 0], p[0][0]) < P_MIN


def test_chi_square_has_power_against_recovering_from_target():
    # Accept with min(1, p/q) but recover from p instead of max(0, p - q): the first
    # token's distribution is min(p, q) + (1 - sum min(p, q)) * p, not p.
    p, q = _tables(seed=1, k=1)
    g = torch.Generator().manual_seed(3)
    d = torch.multinomial(q[0][0], ROWS, replacement=True, generator=g)
    accept = torch.rand(ROWS, generator=g) < (p[0][0][d] / q[0][0][d]).clamp(max=1)
    recovered = torch.multinomial(p[0][0], ROWS, replacement=True, generator=g)
    first = torch.where(accept, d, recovered)
    assert _chi2_pvalue(first, p[0][0]) < P_MIN
