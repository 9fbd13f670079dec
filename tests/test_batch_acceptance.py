"""Device acceptance over a padded batch equals the per-row reference rules.

Greedy: for random trees and chains, padded to one width with extra (never accepted)
nodes and padding, every row's path and emitted tokens equal ``tree_greedy_accept``'s.
Sampling: the batched recursive rejection keeps the target's joint distribution of the
first two tokens (one-hot and drawn q), and the negative control (the second sibling
scored with its parent's q) is caught, as in tests/test_tree_sampling.py.
"""

import random

import numpy as np
import torch

from specray.kernels.batch_acceptance import greedy_accept_batch, tree_rejection_accept_batch
from specray.kernels.tree import TokenTree
from specray.kernels.tree_acceptance import tree_greedy_accept
from tests.test_sampling_e2e import chi2_pvalue


def random_parents(rng: random.Random, n: int, chain: bool) -> list[int]:
    return list(range(n)) if chain else [rng.randrange(0, i + 1) for i in range(n)]


def test_greedy_batch_equals_per_row_trees_and_chains():
    rng = random.Random(0)
    vocab, width, rows = 5, 12, 300
    tokens = torch.zeros(rows, width, dtype=torch.long)
    anc = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)
    depth = torch.arange(width).repeat(rows, 1)
    best = torch.randint(0, vocab, (rows, width), generator=torch.Generator().manual_seed(1))
    sizes, expected = [], []
    for b in range(rows):
        n = rng.randrange(0, width - 2)
        tree = TokenTree.from_parents(random_parents(rng, n, chain=b % 3 == 0))
        # Siblings carry distinct tokens (every proposer's trees do).
        node_tokens = [rng.randrange(vocab)]
        for node in range(1, n + 1):
            taken = {node_tokens[c] for c in tree.children[int(tree.parents[node])] if c < node}
            node_tokens.append(rng.choice([t for t in range(vocab) if t not in taken] or [0]))
        extra = rng.randrange(0, width - n)  # a lookahead-like window that sees the root only
        tokens[b, : n + 1] = torch.tensor(node_tokens)
        tokens[b, n + 1 : n + 1 + extra] = torch.randint(0, vocab, (extra,))
        anc[b, : n + 1, : n + 1] = tree.mask
        anc[b, n + 1 : n + 1 + extra, 0] = True
        depth[b, : n + 1] = tree.depth
        sizes.append(n)
        expected.append(tree_greedy_accept(tree, node_tokens, best[b, : n + 1].tolist()))
    got = greedy_accept_batch(tokens, anc, depth, torch.tensor(sizes), best)
    for b, ref in enumerate(expected):
        n = int(got.num_accepted[b])
        assert n == ref.num_accepted
        assert got.path[b, : n + 1].tolist() == ref.path
        assert got.emitted[b, : n + 1].tolist() == ref.emitted
    assert got.num_accepted.max() >= 2  # the random trees did accept paths


V, TRIALS = 6, 20000


def _dist(g, sharp=1.0):
    return torch.softmax(sharp * torch.randn(V, generator=g, dtype=torch.float64), dim=0)


def run_trials(mode: str):
    """root -> siblings a, b (drawn without replacement from q_root) -> one child each."""
    g = torch.Generator().manual_seed(0)
    p_root = _dist(g)
    p_next = torch.stack([_dist(g) for _ in range(V)])
    q_root = _dist(g, 3.0)
    q_next = torch.stack([_dist(g, 0.5) for _ in range(V)])
    a = torch.multinomial(q_root.expand(TRIALS, -1), 1, generator=g).squeeze(1)
    q_b = q_root.expand(TRIALS, -1).clone()
    q_b[torch.arange(TRIALS), a] = 0
    q_b /= q_b.sum(1, keepdim=True)
    b = torch.multinomial(q_b, 1, generator=g).squeeze(1)
    ca = torch.multinomial(q_next[a], 1, generator=g).squeeze(1)
    cb = torch.multinomial(q_next[b], 1, generator=g).squeeze(1)
    tree = TokenTree.from_parents([0, 0, 1, 2])
    tokens = torch.stack([torch.zeros_like(a), a, b, ca, cb], dim=1)  # [S, 5]
    probs = torch.stack([p_root.expand(TRIALS, -1), p_next[a], p_next[b], p_root.expand(TRIALS, -1),
                         p_root.expand(TRIALS, -1)], dim=1).float()
    second_q = q_root.expand(TRIALS, -1) if mode == "with_replacement" else q_b
    draft = torch.stack([q_root.expand(TRIALS, -1), q_root.expand(TRIALS, -1), second_q, q_next[a], q_next[b]],
                        dim=1).float()
    children = torch.tensor([[1, 2], [3, -1], [4, -1], [-1, -1], [-1, -1]]).expand(TRIALS, -1, -1)
    u = torch.rand(TRIALS, 5, generator=g)
    res = tree_rejection_accept_batch(
        tokens, tree.mask.expand(TRIALS, -1, -1), tree.depth.expand(TRIALS, -1), children, probs, u,
        strides=torch.full((TRIALS,), 2), finals=torch.full((TRIALS,), 4), levels=2,
        draft_probs=None if mode == "one_hot" else draft,
        has_q=None if mode == "one_hot" else torch.ones(TRIALS, dtype=torch.bool),
    )
    first = res.emitted[:, 0]
    second = torch.where(res.num_accepted >= 1, res.emitted[:, 1],
                         torch.multinomial(p_next[first], 1, generator=g).squeeze(1))
    counts = np.zeros((V, V))
    np.add.at(counts, (first.numpy(), second.numpy()), 1)
    return counts, (p_root[:, None] * p_next).numpy(), float(res.num_accepted.float().mean())


def test_batched_tree_rejection_keeps_the_target_distribution():
    counts, exact, accepted = run_trials("exact")
    assert chi2_pvalue(counts, exact) > 1e-3
    counts, exact, accepted_one_hot = run_trials("one_hot")
    assert chi2_pvalue(counts, exact) > 1e-3
    assert accepted > accepted_one_hot + 0.1


def test_batched_tree_rejection_catches_a_wrong_sibling_distribution():
    counts, exact, _ = run_trials("with_replacement")
    assert chi2_pvalue(counts, exact) < 1e-6


def test_compiled_greedy_pass_equals_eager():
    """The step's compiled token match (``greedy_pass`` as ``step=compile`` runs it) equals its
    eager run on random padded trees, over batch sizes and widths. On an AVX-512 CPU, inductor's
    code for the parents' argmax over a uint8 mask once read indices out of range: every
    compiled step failed there, and passed on AVX2 machines."""
    from specray.engine.device_step import greedy_pass
    from specray.policies.compiled import compile_fn

    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    compiled = compile_fn(greedy_pass)
    for rows, width in [(2, 2), (3, 5), (4, 8), (2, 16), (3, 17), (8, 20), (4, 33)]:
        anc = torch.eye(width, dtype=torch.bool).repeat(rows, 1, 1)
        depth = torch.zeros(rows, width, dtype=torch.long)
        for b in range(rows):
            n = rng.randrange(0, width)
            tree = TokenTree.from_parents(random_parents(rng, n, chain=b % 2 == 0))
            anc[b, : n + 1, : n + 1] = tree.mask
            depth[b, : n + 1] = tree.depth
        ids = torch.randint(0, 7, (rows, width), generator=gen)
        sizes = torch.randint(0, width, (rows,), generator=gen)
        logits = torch.randn(rows, width, 7, generator=gen)
        for want, got in zip(greedy_pass(ids, anc, depth, sizes, logits), compiled(ids, anc, depth, sizes, logits)):
            assert torch.equal(want, got), (rows, width)
