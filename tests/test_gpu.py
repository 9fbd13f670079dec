"""CUDA paths (skipped without a GPU): xformers attention equals SDPA; tree verification on GPU."""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_heads", [2, 8])
@pytest.mark.parametrize("tree", [False, True])
def test_xformers_equals_sdpa(dtype, tol, kv_heads, tree):
    from specray.kernels.attention import causal_batch_mask, sdpa_attention, xformers_attention
    from specray.kernels.tree import NAMED_TREES, build_tree

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, d = 3, 8, 64
    lengths = torch.tensor([5, 37, 120], device="cuda")
    t = build_tree(NAMED_TREES["trtllm_example"])
    q = t.size
    kv = int(lengths.max()) + q
    query = torch.randn(b, h, q, d, device="cuda", dtype=dtype, generator=g)
    keys = torch.randn(b, kv_heads, kv, d, device="cuda", dtype=dtype, generator=g)
    values = torch.randn(b, kv_heads, kv, d, device="cuda", dtype=dtype, generator=g)
    tree_mask = t.mask.cuda()[None].expand(b, -1, -1) if tree else None
    mask = causal_batch_mask(lengths, q, kv, dtype, tree_mask)
    ref = sdpa_attention(query, keys, values, mask, d**-0.5)
    out = xformers_attention(query, keys, values, mask, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_tree_verification_on_gpu_matches_cpu():
    from specray.engine.runner import ModelRunner
    from specray.kernels.tree import NAMED_TREES, build_tree
    from tests.conftest import tiny_llama

    model = tiny_llama()
    tree = build_tree(NAMED_TREES["wide"])
    tokens = [[7] + list(range(1, tree.size))]
    outs = []
    for device in ("cpu", "cuda"):
        runner = ModelRunner(copy.deepcopy(model).to(device), num_slots=1, capacity=64)
        runner.forward([0], [[1, 2, 3, 4, 5]])
        out = runner.forward([0], tokens, logits_at=torch.arange(tree.size)[None],
                             layout=(tree.mask[None].to(device), tree.depth[None].to(device)))
        outs.append(out.logits.cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
