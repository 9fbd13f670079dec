"""Token trees: medusa_choices forms, validation, and tree verification in the runner."""

import copy

import pytest
import torch

from specray.engine.runner import ModelRunner
from specray.kernels.tree import NAMED_TREES, TreeError, build_tree, normalize_choices
from tests.conftest import tiny_llama

TRTLLM_PATHS = [[0, 0, 0, 0], [0, 1, 0], [1, 0], [1, 1]]


def test_trtllm_documented_example_expands_to_nine_candidates():
    choices = normalize_choices(TRTLLM_PATHS)
    assert sorted(choices) == sorted(
        [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 1), (0, 1, 0), (1,), (1, 0), (1, 1)]
    )
    assert build_tree(TRTLLM_PATHS).size == 10  # the root + 9 candidates per step
    # The explicit form of the same tree is the same tree.
    assert build_tree([list(c) for c in choices], form="explicit").choices == build_tree(TRTLLM_PATHS).choices


@pytest.mark.parametrize(
    "choices, form, message",
    [
        ([], "auto", "empty"),
        ([[0], [0]], "auto", "twice"),
        ([[0, -1]], "auto", "negative"),
        ([[0], [1, 0]], "explicit", "no parent"),
        ([[]], "auto", "non-empty"),
        ([[0, 0, 0, 0, 0]], "auto", "exceeds"),
        (["ab"], "auto", "non-empty list"),
    ],
)
def test_malformed_trees_raise(choices, form, message):
    with pytest.raises(TreeError, match=message):
        build_tree(choices, form=form, max_depth=4)


@pytest.mark.parametrize("name", list(NAMED_TREES))
def test_structure_is_consistent(name):
    tree = build_tree(NAMED_TREES[name])
    for j in range(1, tree.size):
        ancestors = [i for i in range(tree.size) if tree.mask[j, i] and i != j]
        assert int(tree.parents[j]) == max(ancestors, key=lambda i: int(tree.depth[i]))
        assert int(tree.depth[j]) == len(tree.choices[j - 1])
    leaves = {j for j in range(1, tree.size) if j not in set(tree.parents.tolist())}
    assert {int(p[p >= 0][-1]) for p in tree.paths} == leaves


def test_tree_verification_equals_sequential_paths():
    """Each node's logits equal running its root-to-node path on top of the prefix."""
    ref = tiny_llama()
    runner = ModelRunner(copy.deepcopy(ref), num_slots=3, capacity=64)
    trees = [build_tree(TRTLLM_PATHS), build_tree(NAMED_TREES["wide"])]
    prefixes = [[1, 2, 3, 4, 5, 6, 7], [9, 8]]  # different cached lengths
    slots = [2, 0]
    runner.forward(slots, [p[:-1] for p in prefixes])  # cache all but the root
    g = torch.Generator().manual_seed(0)
    q = max(t.size for t in trees)
    mask = torch.eye(q, dtype=torch.bool).repeat(2, 1, 1)
    depth = torch.zeros(2, q, dtype=torch.long)
    tokens = []
    for i, (t, p) in enumerate(zip(trees, prefixes)):
        mask[i, : t.size, : t.size] = t.mask
        depth[i, : t.size] = t.depth
        tokens.append([p[-1]] + torch.randint(0, 64, (t.size - 1,), generator=g).tolist())
    out = runner.forward(slots, tokens, logits_at=torch.arange(q)[None].expand(2, -1), layout=(mask, depth))
    for i, (t, p) in enumerate(zip(trees, prefixes)):
        for j in range(t.size):
            path, node = [], j
            while node >= 0:
                path.append(tokens[i][node])
                node = int(t.parents[node])
            ids = p[:-1] + path[::-1]
            with torch.no_grad():
                expected = ref(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(out.logits[i, j], expected, atol=1e-5, rtol=0)


def test_compact_keeps_a_path_as_if_decoded_sequentially():
    ref = tiny_llama()
    runner = ModelRunner(copy.deepcopy(ref), num_slots=1, capacity=64)
    tree = build_tree(TRTLLM_PATHS)
    prefix = [3, 1, 4, 1, 5]
    runner.forward([0], [prefix[:-1]])
    base = runner.lengths[0]
    tokens = [prefix[-1]] + list(range(10, 10 + tree.size - 1))
    runner.forward([0], [tokens], layout=(tree.mask[None], tree.depth[None]))
    path = [0, 2, 5]  # root -> (1,) -> (1, 1)
    runner.set_length(0, base)
    runner.compact([0], [path])
    assert runner.lengths[0] == base + 3
    out = runner.forward([0], [[42]])
    kept = [tokens[n] for n in path]
    with torch.no_grad():
        expected = ref(torch.tensor([prefix[:-1] + kept + [42]])).logits[0, -1]
    torch.testing.assert_close(out.logits[0, 0], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["trtllm_example", "wide"])
def test_prefix_equals_the_rebuilt_cut_tree(name):
    tree = build_tree(NAMED_TREES[name])
    for n in range(1, tree.size):
        cut, ref = tree.prefix(n), build_tree(tree.choices[:n], form="explicit")
        assert cut.choices == ref.choices and cut.topk == ref.topk
        for field in ("parents", "mask", "depth"):
            assert torch.equal(getattr(cut, field), getattr(ref, field)), (n, field)
    assert tree.prefix(tree.size) is tree and tree.prefix(2) is tree.prefix(2)


@pytest.mark.parametrize("name", sorted(NAMED_TREES))
def test_xformers_metadata_and_the_parents_path_build_the_same_tree(name):
    """xformers is optional: with it, trees come from its TreeAttnMetadata; without, from the
    choices' parent paths. Both must give the same tree."""
    from specray.kernels.tree import _parents_tree, _xformers_tree

    choices = normalize_choices(NAMED_TREES[name])
    ours, theirs = _parents_tree(choices), _xformers_tree(choices)
    if theirs is None:
        pytest.skip("xformers is not installed")
    assert torch.equal(ours.parents, theirs.parents) and torch.equal(ours.mask, theirs.mask)
    assert torch.equal(ours.depth, theirs.depth)


def test_trees_built_on_the_device_match_the_hosts():
    """``device_layout`` and ``device_children`` (trees whose structure never leaves the
    device: EAGLE-2, ReDrafter) give the ancestor mask, depths and children table that
    ``TokenTree.from_parents`` builds on the host, for a batch of random trees."""
    import random

    from specray.kernels.tree import TokenTree, device_children, device_layout

    rng = random.Random(0)
    for _ in range(50):
        size = rng.randint(1, 12)
        batch = [[rng.randint(0, i) for i in range(size)] for _ in range(3)]  # node i + 1 under an earlier node
        anc, depth = device_layout(torch.tensor(batch), max_depth=size)
        kids = device_children(torch.tensor(batch), max_children=size)
        for b, parents in enumerate(batch):
            tree = TokenTree.from_parents(parents)
            assert torch.equal(anc[b], tree.mask) and torch.equal(depth[b], tree.depth)
            table = tree.children_table
            assert torch.equal(kids[b, :, : table.shape[1]], table) and (kids[b, :, table.shape[1]:] == -1).all()
