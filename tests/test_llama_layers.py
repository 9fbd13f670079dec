"""Unrolled Llama layers (engine/llama_layers.py) compute exactly what transformers' layers do."""

import copy

import pytest
import torch
from torch import nn

from specray.engine.kv_blocks import PagingConfig
from specray.engine.llama_layers import unrolled
from specray.engine.runner import ModelRunner
from specray.kernels.tree import NAMED_TREES, build_tree
from tests.conftest import tiny_llama


def _with_biases(model):
    """Qwen2-style projection biases and an MLP bias, every one non-zero."""
    torch.manual_seed(5)
    for layer in model.model.layers:
        for p in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                  layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            p.bias = nn.Parameter(torch.randn(p.out_features) * 0.3)
    return model


def _pair(model, dtype, paging, mode):
    """(unrolled runner, transformers-layers runner) over copies of the model."""
    runners = []
    for fast in (True, False):
        r = ModelRunner(copy.deepcopy(model).to(dtype), 4, 64, PagingConfig(4, 40) if paging else None)
        if not fast:
            r._unrolled = None
        if mode != "eager":
            r.enable_static(mode, layers=(0, 1))
        runners.append(r)
    assert runners[0]._unrolled is not None
    return runners


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paging", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_unrolled_layers_are_bitwise_equal_to_transformers(dtype, paging, bias):
    model = tiny_llama(layers=3)
    model = _with_biases(model) if bias else model
    tree = build_tree(NAMED_TREES["wide"])
    outs = []
    for r in _pair(model, dtype, paging, "eager"):
        got = [r.forward([0, 2], [[1, 2, 3, 4, 5], [6, 7]], features=True, layers=(0, 2))]  # ragged prefill
        got.append(r.forward([0, 2], [[8], [9]], features=True, layers=(1,)))  # decode
        got.append(r.forward([2], [[7] + list(range(1, tree.size))], logits_at=torch.arange(tree.size)[None],
                             layout=(tree.mask[None], tree.depth[None]), features=True))  # a tree
        outs.append([t for o in got for t in (o.logits, o.hidden, *(o.layers or {}).values())])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_unrolled_layers_are_bitwise_equal_in_the_fixed_shape_step():
    """The uncompiled fixed-shape step (static; cudagraph captures the same function). Compiled
    forwards keep transformers' layers: their graph has no module calls to save."""
    outs = []
    for r in _pair(tiny_llama(layers=2), torch.float32, False, "static"):
        r.forward([0, 1], [[1, 2, 3], [4, 5, 6, 7]])
        a = r.static.run([0, 1], [[8], [9, 10, 11]])
        b = r.static.run([1, 0], [[12], [13]])
        outs.append([t for o in (a, b) for t in (o.logits, o.hidden, *(o.layers or {}).values())])
    assert all(torch.equal(x, y) for x, y in zip(*outs))


def test_anything_but_a_plain_llama_layer_keeps_its_own_forward():
    from specray.engine.quantization import quantize_linears

    runner = ModelRunner(tiny_llama(), 2, 32)
    assert runner._unrolled is not None
    quantized = tiny_llama()
    quantize_linears(quantized)  # FP8 projections
    assert ModelRunner(quantized, 2, 32)._unrolled is None

    class Wrapped(nn.Linear):  # e.g. a sharded or adapted projection
        pass

    changed = tiny_llama()
    old = changed.model.layers[1].mlp.down_proj
    changed.model.layers[1].mlp.down_proj = Wrapped(old.in_features, old.out_features, bias=False)
    assert ModelRunner(changed, 2, 32)._unrolled is None
    assert unrolled(tiny_llama().train().model) is None


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_eagle3_heads_widened_layer_runs_unrolled_and_bitwise_equal(norm_before_residual, dtype):
    """EAGLE-3's midlayer reads pairs [embedding; g] (2H wide): unrolled, its prefill, tree and
    decode forwards equal its module forward exactly."""
    from tests.test_eagle3 import bound, random_head3

    target = tiny_llama(layers=3)
    head = bound(target, random_head3(target))
    head.midlayer.norm_before_residual = norm_before_residual
    tree = build_tree(NAMED_TREES["wide"])
    g = torch.Generator().manual_seed(3)
    outs = []
    for fast in (True, False):
        r = ModelRunner(copy.deepcopy(head).to(dtype), 3, 64)
        if fast:
            assert r._unrolled is not None and r._unrolled[0].pair is not None
        else:
            r._unrolled = None
        pairs = lambda n: torch.randn(n, 2 * head.config.hidden_size, generator=g.manual_seed(n)).to(dtype)  # noqa: E731
        got = [r.forward([0, 2], [[1, 2, 3, 4, 5], [6, 7]], features=True, embeds=[pairs(5), pairs(2)])]
        got.append(r.forward([2], [list(range(1, tree.size + 1))], logits_at=torch.arange(tree.size)[None],
                             layout=(tree.mask[None], tree.depth[None]), features=True, embeds=[pairs(tree.size)]))
        got.append(r.forward([0, 2], [[8], [9]], features=True, embeds=[pairs(1), pairs(1)]))
        outs.append([t for o in got for t in (o.logits, o.hidden, o.features)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
