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


def _xformers_runs() -> bool:
    try:
        from specray.kernels.backends import attention_backend
    except ImportError:  # the probe module
        return False
    return attention_backend("cuda")[0] == "xformers"


needs_xformers = pytest.mark.skipif(not _xformers_runs(), reason="xformers' CUDA kernels do not run here")
test_xformers_equals_sdpa = needs_xformers(test_xformers_equals_sdpa)


@pytest.mark.parametrize("mode", ["static", "cudagraph", "graphs"])
def test_captured_step_equals_eager_for_every_method(tiny_pair, mode):
    """float32 on the GPU: the fixed-shape step, captured or not, equals the eager one."""
    from tests.test_engine import GREEDY, ragged_prompts
    from tests.test_static_step import SPECS, speculation

    prompts = ragged_prompts(8)
    target, draft = (m.to("cuda") for m in copy.deepcopy(tiny_pair))
    for name in SPECS:
        outs = {}
        for step in ("eager", mode):
            engine = _cuda_engine((target, draft), step)
            outs[step] = [o.token_ids for o in engine.generate(prompts, GREEDY, speculation(name))]
        assert outs[mode] == outs["eager"], name


def _cuda_engine(models, step, dtype=None):
    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine
    from specray.policies.spec_length import SpeculationLengthPolicy
    from tests.test_eagle import random_head
    from tests.test_eagle3 import random_head3
    from tests.test_medusa import random_heads
    from tests.test_redrafter import random_drafter

    target, draft = (copy.deepcopy(m) for m in models)
    if dtype is not None:
        target, draft = target.to(dtype), draft.to(dtype)
    return LLMEngine(
        EngineConfig(target="x", max_num_seqs=4, step=step, device="cuda",
                     speculation_length=SpeculationLengthPolicy()),
        target_model=target, draft_model=draft, medusa_heads=random_heads().cuda(),
        resources={"eagle": random_head(models[0]).cuda(), "eagle3": random_head3(models[0]).cuda(),
                   "redrafter": random_drafter().cuda()},
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_method_runs_in_half_precision_on_the_gpu(tiny_pair, dtype):
    from specray.engine.params import SamplingParams
    from tests.test_engine import ragged_prompts
    from tests.test_static_step import SPECS, speculation

    models = tuple(m.to("cuda") for m in copy.deepcopy(tiny_pair))
    for step in ("eager", "graphs"):
        engine = _cuda_engine(models, step, dtype)
        for name in SPECS:
            for temperature in (0.0, 0.8):
                outs = engine.generate(ragged_prompts(4), SamplingParams(max_tokens=12, temperature=temperature, seed=1,
                                                                         ignore_eos=True), speculation(name))
                assert all(len(o.token_ids) == 12 for o in outs), (step, name)


def test_gpu_benchmark_runs(tmp_path):
    from specray.bench import gpu

    assert gpu.main(["--shape", "tiny", "--batch", "1,2", "--max-tokens", "16", "--profile-steps", "4",
                     "--modes", "cudagraph,graphs", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "gpu.png").stat().st_size > 0


@pytest.mark.parametrize("mode", ["static", "cudagraph"])
def test_captured_greedy_equals_hf_generate_after_many_replays(tiny_pair, mode):
    """float32: every prompt's greedy output equals HF ``generate``'s, plain and drafted, at batch
    8 and 1. Each graph is replayed many times after its capture: a tensor it reads that was
    freed after capture (first seen on an H100) corrupts the replays, not the first step."""
    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine
    from specray.engine.params import SpeculationParams
    from tests.test_engine import GREEDY, ragged_prompts

    target, draft = (m.to("cuda") for m in copy.deepcopy(tiny_pair))
    prompts = ragged_prompts(8)
    ref = [target.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                                                                                           device="cuda"),
                           max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, len(p):].tolist() for p in prompts]
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=8, step=mode, device="cuda"),
                       target_model=target, draft_model=draft)
    for spec in ({"method": "none"}, {"method": "draft", "num_speculative_tokens": 4}):
        for group in (prompts, prompts[:1]):
            outs = [o.token_ids for o in engine.generate(group, GREEDY, SpeculationParams(**spec))]
            assert outs == ref[: len(group)], (spec, len(group))
