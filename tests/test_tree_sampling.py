"""Recursive rejection over siblings keeps the target's distribution for *sampled* trees.

Each node carries the distribution it was drawn from (siblings drawn without replacement,
so the second child's q excludes the first child's token). The first two emitted tokens of
many trials must follow the target's joint distribution exactly. Negative control: scoring
the second sibling with its parent's q (forgetting that it was drawn without replacement)
is biased and fails the same test. Scoring the nodes as deterministic proposals (one-hot q)
stays exact but accepts less: the probabilities are what make sampled trees pay.
"""

import numpy as np
import torch

from specray.kernels.tree import TokenTree
from specray.kernels.tree_acceptance import tree_rejection_accept
from tests.test_sampling_e2e import chi2_pvalue

V, TRIALS = 6, 10000


def _dist(g, sharp=1.0):
    return torch.softmax(sharp * torch.randn(V, generator=g, dtype=torch.float64), dim=0)


def _draw(q, g):
    return int(torch.multinomial(q, 1, generator=g))


def _without(q, tok):
    q = q.clone()
    q[tok] = 0
    return q / q.sum()


def run_trials(mode: str) -> tuple[np.ndarray, np.ndarray, float]:
    g = torch.Generator().manual_seed(0)
    p_root = _dist(g)  # the target after the root
    p_next = torch.stack([_dist(g) for _ in range(V)])  # the target after each first token
    q_root = _dist(g, 3.0)  # the drafter's distributions
    q_next = torch.stack([_dist(g, 0.5) for _ in range(V)])
    # root -> two siblings a, b (without replacement) -> each with one child sampled from q_next
    tree = TokenTree.from_parents([0, 0, 1, 2])
    counts, accepted = np.zeros((V, V)), 0
    for _ in range(TRIALS):
        a = _draw(q_root, g)
        q_b = _without(q_root, a)
        b = _draw(q_b, g)
        ca, cb = _draw(q_next[a], g), _draw(q_next[b], g)
        tokens = [0, a, b, ca, cb]
        # The target after each node; after the leaves (a third token) any fixed one serves:
        # only the first two emitted tokens are counted.
        probs = torch.stack([p_root, p_next[a], p_next[b], p_root, p_root])
        draft = torch.stack([q_root, q_root, q_root if mode == "with_replacement" else q_b, q_next[a], q_next[b]])
        res = tree_rejection_accept(tree, tokens, probs, g, None if mode == "one_hot" else draft)
        accepted += res.num_accepted
        first, second = res.emitted[0], res.emitted[1] if len(res.emitted) > 1 else None
        if second is None:  # stopped at the root: draw the next token from the target itself
            second = _draw(p_next[first], g)
        counts[first, second] += 1
    exact = (p_root[:, None] * p_next).numpy()
    return counts, exact, accepted / TRIALS


def test_sampled_tree_nodes_keep_the_target_distribution():
    counts, exact, accepted = run_trials("exact")
    assert chi2_pvalue(counts, exact) > 1e-3
    counts, exact, accepted_one_hot = run_trials("one_hot")
    assert chi2_pvalue(counts, exact) > 1e-3  # deterministic proposals: exact too
    assert accepted > accepted_one_hot + 0.1  # ... but the draft's q accepts more


def test_a_wrong_sibling_distribution_is_caught():
    counts, exact, _ = run_trials("with_replacement")
    assert chi2_pvalue(counts, exact) < 1e-6
