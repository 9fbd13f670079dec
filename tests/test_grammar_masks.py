"""The batch's grammar masks (``engine/grammar.py``: ``allowed_masks``) against a reference made
node by node: a fresh llguidance matcher walks each node's path, fills its mask alone, and the
EOS bit is read as the rows' stop tokens. Root-only rows, chains (one llguidance call for the
batch) and trees (walked row by row) must all give exactly that, and leave the matchers where
they were."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ALPHABET

REGEX = "[a-c]{2}(x[0-9]|yz)+"


def encode(text: str) -> list[int]:
    return [ALPHABET.index(c) for c in text]


def reference(grammars, source, stops, done, path) -> torch.Tensor:
    """[V] bool: what may follow ``path`` after the kept tokens ``done``, by a fresh matcher."""
    import llguidance
    import llguidance.torch as lt

    from specray.engine.grammar import unpack

    vocab = grammars.vocab_size
    matcher = llguidance.LLMatcher(grammars.ll_tokenizer, source)
    assert matcher.consume_tokens(done)
    for t in path:
        if matcher.is_stopped() or matcher.validate_tokens([t]) != 1:
            return torch.ones(vocab, dtype=torch.bool)  # a refused node: unmasked
        matcher.consume_token(t)
    bits = lt.allocate_token_bitmask(1, grammars.width)
    lt.fill_next_token_bitmask(matcher, bits, 0)
    every = unpack(bits, grammars.width)[0]
    out = every[:vocab].clone()
    eos = grammars.eos_id
    if eos < vocab and eos not in stops:
        out[eos] = False
    for s in stops:
        out[s] |= bool(every[eos])
    return out if out.any() else torch.ones(vocab, dtype=torch.bool)


@pytest.mark.parametrize("eos, stops", [(None, {5}), (63, {63, 5}), (63, {5})],
                         ids=["stand-in-eos", "eos-a-stop", "eos-no-stop"])
def test_batch_masks_equal_each_nodes_own_matcher(char_tokenizer, eos, stops):
    from specray.engine.grammar import Grammars, allowed_masks

    grammars = Grammars(char_tokenizer, len(ALPHABET), eos)
    source = grammars.source("regex", REGEX)
    done = encode("ab")
    stops = frozenset(stops)
    # per row: kept tokens' continuation as nodes (node 0 the root), parents (None: a chain)
    rows = [
        None,  # a free row
        (encode("x"), None),  # the root alone
        (encode("x1yz"), None),  # a chain the grammar takes whole
        (encode("xqx"), None),  # a chain refused at its second node (and what is below it)
        (encode("x1yx"), [-1, 0, 0, 2]),  # a tree: two children of the root, one with a child
    ]
    width = 4
    row_grammars = [None if r is None else grammars.matcher(source, stops, done) for r in rows]
    tokens = [[0] if r is None else r[0] for r in rows]
    parents = [None if r is None else r[1] for r in rows]
    out = allowed_masks(row_grammars, tokens, parents, width)  # [R, W, V]
    assert out.shape == (len(rows), width, len(ALPHABET))
    for i, r in enumerate(rows):
        if r is None:
            assert out[i].all()
            continue
        nodes, par = r[0], r[1] or list(range(-1, len(r[0]) - 1))
        for j in range(width):
            if j >= len(nodes):  # padding: unmasked
                assert out[i, j].all()
                continue
            path, k = [], j
            while k > 0:
                path.append(nodes[k])
                k = par[k]
            want = reference(grammars, source, stops, done, path[::-1])
            assert torch.equal(torch.from_numpy(out[i, j].copy()), want), (i, j)
    for g in row_grammars:  # every matcher is where it started: after the kept tokens
        if g is not None:
            assert g.valid_prefix(encode("x1")) == 2 and g.valid_prefix(encode("a")) == 0
