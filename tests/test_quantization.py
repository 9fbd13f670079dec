"""FP8 weights: the kernels, the bytes, losslessness of every method against the FP8 target's own
plain decoding, published FP8 checkpoints (Meta's fbgemm_fp8, vLLM's fp8, compressed-tensors)
loading equal to their dequantized reference, refusals at start-up, and the plumbing from the
CLI, YAML files, batch jobs and EngineConfig."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from specray.engine.checkpoints import checkpoint_problems
from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.quantization import (FP8Linear, UnsupportedQuantizationError, describe, quantize_linears,
                                         weight_bytes)
from specray.engine.runner import load_model
from specray.kernels import fp8
from tests.conftest import hf_greedy, tiny_llama
from tests.test_bf16 import SPECS as BF16_SPECS, resources
from tests.test_engine import GREEDY, ragged_prompts

E4M3 = torch.float8_e4m3fn
SPECS = {**BF16_SPECS, "suffix": {"method": "suffix", "num_speculative_tokens": 8}}  # none, draft, ngram, medusa, eagle-1/2, eagle3, redrafter, lookahead


# -- kernels ---------------------------------------------------------------------------------
def test_per_channel_quantization_keeps_each_row_within_fp8_precision():
    torch.manual_seed(0)
    w = torch.randn(16, 40) * torch.logspace(-3, 2, 16)[:, None]  # rows five decades apart
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, s = fp8.quantize_per_channel(w)
    assert q.dtype == E4M3 and s.shape == (16, 1) and s.dtype == torch.float32
    back = fp8.dequantize(q, s)
    assert torch.equal(back[3], torch.zeros(40))
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of its row's largest (relative to it)
    err = (back - w).abs().amax(1) / w.abs().amax(1).clamp(min=1e-30)
    assert err.max() <= 1 / 16
    assert (q.float().abs().amax(1)[w.abs().amax(1) > 0] == fp8.FP8_MAX).all()  # each row uses the whole range


def test_dequantize_reads_tensor_channel_and_block_scales():
    torch.manual_seed(0)
    q = (torch.randn(5, 7) * 50).to(E4M3)
    qf = q.float()
    assert torch.equal(fp8.dequantize(q, torch.tensor(0.5)), qf * 0.5)
    assert torch.equal(fp8.dequantize(q, torch.tensor([0.5])), qf * 0.5)
    rows = torch.arange(1.0, 6.0)
    assert torch.equal(fp8.dequantize(q, rows), qf * rows[:, None])
    assert torch.equal(fp8.dequantize(q, rows[:, None]), qf * rows[:, None])
    blocks = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])  # 2x3 tiles over 5x7, ragged edges
    expected = torch.empty(5, 7)
    for i in range(5):
        for j in range(7):
            expected[i, j] = qf[i, j] * blocks[i // 2, j // 3]
    assert torch.equal(fp8.dequantize(q, blocks, block=(2, 3)), expected)
    with pytest.raises(ValueError, match="must be"):
        fp8.dequantize(q, blocks[:2], block=(2, 3))
    with pytest.raises(ValueError, match="fits neither"):
        fp8.dequantize(q, torch.ones(3))
    assert fp8.scale_kind((), (5, 7), None) == "tensor"
    assert fp8.scale_kind((5, 1), (5, 7), None) == "channel"
    assert fp8.scale_kind((3, 3), (5, 7), (2, 3)) == "block"
    with pytest.raises(ValueError, match="neither per tensor"):
        fp8.scale_kind((7,), (5, 7), None)


def test_fp8_linear_is_the_linear_of_its_dequantized_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 10)
    layer = FP8Linear.quantized(linear)
    x = torch.randn(3, 4, 24)
    reference = torch.nn.functional.linear(x, fp8.dequantize(layer.weight, layer.weight_scale), linear.bias)
    assert torch.equal(layer(x), reference)
    assert layer.weight.dtype == E4M3 and not layer.weight.requires_grad
    assert (layer(x) - linear(x)).abs().max() < 0.05 * linear(x).abs().max()  # and close to the float layer


def test_the_scaled_mm_option_is_refused_where_there_is_no_fp8_matmul(tiny_checkpoints):
    problem = fp8.scaled_mm_problem("cpu")
    assert "CUDA" in problem
    with pytest.raises(UnsupportedQuantizationError, match="scaled_mm"):
        load_model(tiny_checkpoints["target"], "float32", "cpu", "fp8", fp8_kernel="scaled_mm")
    problems = checkpoint_problems(EngineConfig(target=tiny_checkpoints["target"], device="cpu", fp8_kernel="scaled_mm"))
    assert [p.key for p in problems] == ["fp8_kernel"] and "use dequantize" in problems[0].message


def test_specray_env_says_what_fp8_runs_here():
    from specray.entrypoints.environment import describe as environment

    line = next(x for x in environment().splitlines() if x.startswith("fp8"))
    assert "dequantized for each matmul" in line
    assert ("scaled_mm (W8A8): available" in line) == (fp8.scaled_mm_problem("cuda") is None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or fp8.scaled_mm_problem("cuda") is not None,
                    reason="needs a CUDA GPU of compute capability >= 8.9")
def test_scaled_mm_is_close_to_the_weight_only_reference_on_a_gpu():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128, device="cuda", dtype=torch.bfloat16)
    w8a16, w8a8 = FP8Linear.quantized(linear), FP8Linear.quantized(linear, kernel="scaled_mm")
    assert w8a8.kernel == "scaled_mm"
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    ref = w8a16(x).float()
    assert ((w8a8(x).float() - ref).abs().max() / ref.abs().max()).item() < 0.05


# -- bytes -----------------------------------------------------------------------------------
def wide_llama(dtype):
    """Linear layers dominate (hidden 256, vocab 64), as in real models past a few hundred M parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, 1 / 2), (torch.float32, 1 / 4)], ids=["bf16", "fp32"])
def test_fp8_holds_half_of_bf16s_bytes_and_a_quarter_of_fp32s(dtype, ratio):
    model = wide_llama(dtype)
    linear_before, total_before = weight_bytes(model)
    assert quantize_linears(model) == 14  # 7 per layer; the LM head stays
    linear_after, total_after = weight_bytes(model)
    # 1 byte per weight plus one float32 scale per output row (in_features 256 or 512)
    assert ratio <= linear_after / linear_before <= ratio * (1 + 4 / 256)
    assert ratio < total_after / total_before < ratio * 1.1  # embeddings, head and norms: the rest
    assert "14 linear layers in float8_e4m3fn" in describe(model)


def test_load_model_quantizes_a_bf16_checkpoint_before_it_moves(tiny_checkpoints, tmp_path):
    wide_llama(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    plain = load_model(str(tmp_path / "bf16"), "bfloat16")
    quantized = load_model(str(tmp_path / "bf16"), "bfloat16", quantization="fp8")
    layer = quantized.model.layers[0].mlp.down_proj
    assert isinstance(layer, FP8Linear) and layer.weight.dtype == E4M3 and layer.weight_scale.shape == (256, 1)
    assert quantized.lm_head.weight.dtype == torch.bfloat16  # kept, for the heads that read it
    assert weight_bytes(quantized)[1] / weight_bytes(plain)[1] < 0.55


def test_the_kv_cache_is_sized_with_the_fp8_weights(tmp_path):
    """On a GPU the cache gets what the weights leave: FP8 weights are counted at their FP8 size,
    computed on the meta device from config.json alone (equal to what the loaded model holds)."""
    from specray.engine.memory import plan_for_checkpoints
    from specray.engine.quantization import planned_weight_bytes

    wide_llama(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    path = str(tmp_path / "bf16")
    assert planned_weight_bytes(path, "bfloat16", None) is None  # unquantized: sized from its files
    planned = planned_weight_bytes(path, "bfloat16", "fp8")
    assert planned == weight_bytes(load_model(path, "bfloat16", quantization="fp8"))[1]
    # free memory for the activation reserve, the bf16 weights (and their 5% share) and two sequences
    reserve, per_sequence = 512 * 2**20, 64 * 1024  # 2 layers x 2 KV heads x 64 dims x K, V x 2 bytes x 64 tokens
    bf16 = (tmp_path / "bf16" / "model.safetensors").stat().st_size
    free = reserve + int(1.05 * bf16) + 2 * per_sequence + 4096
    plain, fp8_plan = (plan_for_checkpoints([path], "bfloat16", max_model_len=64, max_num_seqs=None, utilization=1.0,
                                            device="cuda", free_total=(free, free), quantization=[q])
                       for q in (None, "fp8"))
    assert plain.max_num_seqs == 2 and fp8_plan.max_num_seqs >= 18  # the ~1.2 MB FP8 leaves: 64 KiB sequences


# -- every method stays lossless against the FP8 target's plain decoding ------------------------
@pytest.fixture(scope="module")
def fp8_pair(tiny_pair):
    """(the tiny target quantized, its draft quantized, HF greedy of the quantized target)."""
    target, draft = (copy.deepcopy(m) for m in tiny_pair)
    quantize_linears(target)
    quantize_linears(draft)
    refs = [hf_greedy(target, p, GREEDY.max_tokens) for p in ragged_prompts(6)]
    float_refs = [hf_greedy(tiny_pair[0], p, GREEDY.max_tokens) for p in ragged_prompts(6)]
    assert refs != float_refs  # quantization really changed the model: the reference is its own
    return target, draft, refs


def fp8_engine(tiny_pair, fp8_pair, max_num_seqs, quantized_draft=True, **kw):
    target, draft, _ = fp8_pair
    # No profile: the budget drafts from the first steps (the table fills from served steps), so
    # each method's drafts are checked whatever the machine's load made a profile read.
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, **{"profile_costs": False, **kw}),
                     target_model=copy.deepcopy(target),
                     draft_model=copy.deepcopy(draft if quantized_draft else tiny_pair[1]),
                     resources=resources(tiny_pair[0]))


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", list(SPECS))
def test_every_method_equals_the_fp8_targets_plain_decoding(tiny_pair, fp8_pair, name, batch):
    spec = SPECS[name]
    engine = fp8_engine(tiny_pair, fp8_pair, batch)
    outs = engine.generate(ragged_prompts(6), GREEDY, SpeculationParams(**spec))
    assert [o.token_ids for o in outs] == fp8_pair[2]
    if spec["method"] != "none":
        assert engine.totals.num_drafts > 0


@pytest.mark.parametrize("step", ["eager", "static"])
def test_an_unquantized_draft_with_an_fp8_target_stays_lossless(tiny_pair, fp8_pair, step):
    engine = fp8_engine(tiny_pair, fp8_pair, 4, quantized_draft=False, step=step)
    for spec in ({"method": "draft", "num_speculative_tokens": 3}, {"method": "eagle"}):
        outs = engine.generate(ragged_prompts(6), GREEDY, SpeculationParams(**spec))
        assert [o.token_ids for o in outs] == fp8_pair[2]
    assert not any(isinstance(m, FP8Linear) for m in engine.resources["draft"].decoder.modules())


def test_sampling_runs_through_fp8_layers(tiny_pair, fp8_pair):
    engine = fp8_engine(tiny_pair, fp8_pair, 4)
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]
    outs = engine.generate(ragged_prompts(4), sampled, SpeculationParams(method="draft", num_speculative_tokens=3))
    assert all(len(o.token_ids) == 12 for o in outs)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi",
                                  "phi3", "starcoder2", "gpt2", "gpt_bigcode", "gpt_neox", "opt"])
def test_every_served_architecture_quantizes_and_stays_lossless(name):
    """Each family's linear layers (GPT-2's Conv1D included) go to FP8, the LM head stays; plain and
    draft decoding of the FP8 pair equal HF generate of the FP8 target."""
    from tests.test_architectures import ARCHS, GREEDY as ARCH_GREEDY, PROMPTS, family

    assert name in ARCHS
    target, draft = (copy.deepcopy(m) for m in family(name)[:2])
    assert quantize_linears(target) >= 4 * target.config.get_text_config().num_hidden_layers // 2
    quantize_linears(draft)
    assert not isinstance(target.get_output_embeddings(), FP8Linear)
    assert not any(isinstance(m, torch.nn.Linear) and m is not target.get_output_embeddings()
                   for m in target.modules())
    refs = [hf_greedy(target, p, ARCH_GREEDY.max_tokens) for p in PROMPTS]
    for method in ("none", "draft"):
        engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(target),
                           draft_model=copy.deepcopy(draft) if method == "draft" else None)
        spec = SpeculationParams(method=method, **({"num_speculative_tokens": 3} if method == "draft" else {}))
        assert [o.token_ids for o in engine.generate(PROMPTS, ARCH_GREEDY, spec)] == refs, method


# -- checkpoints published in FP8 --------------------------------------------------------------
IGNORED = "model.layers.1.mlp.down_proj"  # left in bf16 by the "checkpoint's makers"


def write_published(path, model, layout: str) -> torch.nn.Module:
    """Save ``model`` in a published FP8 layout; returns the float32 reference: the same model
    with every stored FP8 weight replaced by its dequantized value."""
    reference = copy.deepcopy(model).float()
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    block = (16, 16) if layout == "fp8-block" else None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head" or name == IGNORED:
            continue
        w = module.weight.detach().float()
        if layout in ("fp8-tensor", "ct-tensor"):
            scale = w.abs().max() / fp8.FP8_MAX
            q = (w / scale).to(E4M3)
            scale = scale.reshape(()) if layout == "fp8-tensor" else scale.reshape(1)
        elif block is not None:
            grid = w.reshape(w.shape[0] // 16, 16, w.shape[1] // 16, 16).abs().amax((1, 3)) / fp8.FP8_MAX
            q = (w / grid.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(E4M3)
            scale = grid
        else:  # per output channel, [out, 1]
            q, scale = fp8.quantize_per_channel(w)
        state[f"{name}.weight"] = q
        state[f"{name}.weight_scale_inv" if block else f"{name}.weight_scale"] = scale.float()
        if layout in ("fp8-tensor", "ct-tensor"):
            state[f"{name}.input_scale"] = torch.tensor(0.02)  # static activation scale: unused by W8A16
        reference.get_submodule(name).weight.data = fp8.dequantize(q, scale, block)
    ignored = reference.get_submodule(IGNORED)
    ignored.weight.data = ignored.weight.data.to(torch.bfloat16).float()
    reference.model.embed_tokens.weight.data = model.model.embed_tokens.weight.data.to(torch.bfloat16).float()
    for name in ("lm_head",):
        reference.get_submodule(name).weight.data = model.get_submodule(name).weight.data.to(torch.bfloat16).float()
    for n, p in reference.named_parameters():  # norms: stored in bf16 too
        if "norm" in n:
            p.data = p.data.to(torch.bfloat16).float()
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = QUANTIZATION_CONFIGS[layout]
    (path / "config.json").write_text(json.dumps(cfg))
    return reference.eval()


def _ct(strategy: str, inputs: dict | None, **weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head", IGNORED],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": inputs, "output_activations": None,
                                          "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                      "dynamic": False, "strategy": strategy, **weights}}}}


QUANTIZATION_CONFIGS = {
    # Meta's Llama-3.1-405B-FP8 / -70B-FP8 (transformers' FbgemmFp8Config)
    "fbgemm": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": [IGNORED]},
    # vLLM's fp8 (AutoFP8): per-tensor weight scales, static input scales
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": [IGNORED]},
    # DeepSeek-V3-style 128x128 (here 16x16) block scales, stored as weight_scale_inv
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
                  "ignored_layers": [IGNORED]},
    # llm-compressor's FP8_DYNAMIC (per channel, per-token dynamic activations) and FP8 (per tensor, static)
    "ct-channel": _ct("channel", {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                  "strategy": "token"}),
    "ct-tensor": _ct("tensor", {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                "strategy": "tensor"}),
}


@pytest.mark.parametrize("layout", list(QUANTIZATION_CONFIGS))
def test_a_published_fp8_checkpoint_loads_and_equals_its_dequantized_reference(tmp_path, layout):
    model = tiny_llama(layers=2, seed=3)
    reference = write_published(tmp_path, model, layout)
    config = EngineConfig(target=str(tmp_path))
    assert checkpoint_problems(config) == []
    loaded = load_model(str(tmp_path), "float32")
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, FP8Linear)}
    assert len(layers) == 13 and IGNORED not in layers  # 14 linear layers, one left in bf16 by the checkpoint
    assert all(m.weight.dtype == E4M3 for m in layers.values())
    ids = torch.tensor([ragged_prompts(1, seed=5)[0]])
    loaded.set_attn_implementation("sdpa")  # loaded for the runner's attention; compared here as HF runs it
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
    # served: plain decoding and speculation equal the reference's greedy continuations
    prompts = ragged_prompts(4)
    refs = [hf_greedy(reference, p, 12) for p in prompts]
    engine = LLMEngine(EngineConfig(target=str(tmp_path), max_num_seqs=4))
    short = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for spec in ({"method": "none"}, {"method": "ngram", "num_speculative_tokens": 3}):
        assert [o.token_ids for o in engine.generate(prompts, short, SpeculationParams(**spec))] == refs


# -- refusals at start-up ------------------------------------------------------------------------
def _with_config(path, model, quantization_config, state=None):
    model.save_pretrained(path)
    if state is not None:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({**_ct("channel", None), "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                                                                    "symmetric": True, "dynamic": False}}}},
     "8-bit int"),
    ({**_ct("channel", None), "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({**_ct("group", None)}, "strategy 'group'"),
], ids=["gptq", "awq", "ct-int8", "ct-packed", "ct-group"])
def test_a_quantization_config_specray_cannot_read_is_refused(tmp_path, quantization_config, message):
    path = _with_config(tmp_path / "t", tiny_llama(), quantization_config)
    problems = checkpoint_problems(EngineConfig(target=path))
    assert [p.key for p in problems] == ["target"] and message in problems[0].message
    assert "specray loads FP8 checkpoints as published" in problems[0].message or "specray reads" in problems[0].message
    with pytest.raises(UnsupportedQuantizationError, match=message.split()[0]):
        load_model(path)


def test_fp8_tensors_without_scales_or_in_e5m2_are_refused(tmp_path):
    model = tiny_llama()
    state = dict(model.state_dict())
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(E4M3)
    state["model.layers.0.mlp.gate_proj.weight"] = state["model.layers.0.mlp.gate_proj.weight"].to(torch.float8_e5m2)
    state["model.layers.0.mlp.gate_proj.weight_scale"] = torch.ones(64, 1)
    state = {k: v.contiguous() for k, v in state.items()}
    path = _with_config(tmp_path / "t", model, QUANTIZATION_CONFIGS["fbgemm"], state)
    [problem] = checkpoint_problems(EngineConfig(target=path))
    assert "up_proj.weight is FP8 without a" in problem.message and "float8_e5m2" in problem.message
    # a quantization_config over plain weights is a contradiction, named too
    plain = _with_config(tmp_path / "p", model, QUANTIZATION_CONFIGS["fbgemm"])
    assert "no tensor is stored in FP8" in checkpoint_problems(EngineConfig(target=plain))[0].message


def test_bad_settings_are_refused_with_their_names(tiny_checkpoints):
    with pytest.raises(UnsupportedQuantizationError, match="quantization 'int8' is not supported"):
        EngineConfig(quantization="int8")
    with pytest.raises(UnsupportedQuantizationError, match="draft_quantization 'nf4'"):
        EngineConfig(draft_quantization="nf4")
    with pytest.raises(UnsupportedQuantizationError, match="fp8_kernel 'marlin'"):
        EngineConfig(fp8_kernel="marlin")
    problems = checkpoint_problems(EngineConfig(target=tiny_checkpoints["target"], draft_quantization="fp8"))
    assert [p.key for p in problems] == ["draft_quantization"] and "none is loaded" in problems[0].message


# -- entry points ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_refs(tiny_pair):
    """HF greedy continuations (8 tokens) of the quantized tiny target for a few text prompts."""
    from tests.conftest import encode

    target = copy.deepcopy(tiny_pair[0])
    quantize_linears(target)
    prompts = ["abcabcab", "Hello", "x0x0x0x0x0x"]
    return prompts, [hf_greedy(target, encode(p), 8) for p in prompts]


def test_generate_with_quantization_flags_and_a_yaml_config(tiny_tok, fp8_refs, tmp_path, capsys):
    from specray.entrypoints.cli import main

    prompts, refs = fp8_refs
    base = ["generate", "--target", tiny_tok["target"], "--tokenizer", tiny_tok["tokenizer"], "--max-tokens", "8",
            "--ignore-eos", "--json"]
    assert main([*base, "--prompt", prompts[0], "--quantization", "fp8", "--method", "none"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["token_ids"] == refs[0]
    # a YAML config (vLLM's flat names): the draft quantized through --speculative-config's quantization
    config = tmp_path / "fp8.yaml"
    config.write_text(f"quantization: fp8\nspeculative-config:\n  method: draft\n  model: {tiny_tok['draft']}\n"
                      "  num_speculative_tokens: 3\n  quantization: fp8\n")
    assert main([*base, "--prompt", prompts[1], "--config", str(config)]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["token_ids"] == refs[1] and reply["method"] == "draft" and reply["metrics"]["num_drafts"] > 0
    # the flat spellings: -q and --draft-quantization
    assert main([*base, "--prompt", prompts[2], "-q", "fp8", "--draft", tiny_tok["draft"], "--draft-quantization", "fp8",
                 "--method", "draft"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == refs[2]


@pytest.mark.parametrize("argv, message", [
    (["--quantization", "int4"], "--quantization int4: quantization 'int4' is not supported"),
    (["--draft-quantization", "fp8"], "--draft-quantization: quantizes the draft model, but none is loaded"),
    (["--speculative-config", '{"method": "ngram", "quantization": "fp8"}'],
     "'quantization' is the draft model's (method draft)"),
    (["--fp8-kernel", "scaled_mm", "--device", "cpu"], "--fp8-kernel: scaled_mm: FP8 matmuls"),
], ids=["unknown method", "no draft", "not a draft method", "scaled_mm on cpu"])
def test_bad_quantization_flags_are_one_line_before_anything_loads(tiny_tok, argv, message, capsys):
    from specray.entrypoints.cli import main

    code = main(["generate", "--target", tiny_tok["target"], "--tokenizer", tiny_tok["tokenizer"], "--prompt", "ab",
                 *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_an_unreadable_quantization_is_named_with_its_flag(tiny_tok, tmp_path, capsys):
    from specray.entrypoints.cli import main

    path = _with_config(tmp_path / "gptq", tiny_llama(), {"quant_method": "gptq", "bits": 4})
    code = main(["generate", "--target", path, "--tokenizer", tiny_tok["tokenizer"], "--prompt", "ab"])
    err = capsys.readouterr().err
    assert code == 2 and f"--target {path}: its quantization_config says quant_method 'gptq'" in err


def test_serve_and_job_configs_carry_quantization(tiny_tok, tmp_path):
    from specray.engine.memory import KVPlan
    from specray.entrypoints.jobs import load_config
    from specray.entrypoints.serving import startup_lines
    from specray.serve.config import ServeConfig

    cfg = ServeConfig.model_validate({"model": tiny_tok["target"], "draft": tiny_tok["draft"], "quantization": "fp8",
                                      "fp8-kernel": "dequantize", "draft-quantization": "fp8"})
    engine = cfg.engine.engine_config()
    assert (engine.quantization, engine.draft_quantization, engine.fp8_kernel) == ("fp8", "fp8", "dequantize")
    lines = startup_lines(cfg, KVPlan(4, 64, 1, "given"))
    assert any(line.startswith("quantization: target fp8 (quantized at load, per-channel scales), draft fp8")
               and "dequantized for each matmul" in line for line in lines), lines
    assert "tensor parallel size 1 (the target whole on one device)" in lines
    split = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"tensor_parallel_size": 2})})
    assert any(line.startswith("tensor parallel size 2: the target split over 2 ranks")
               for line in startup_lines(split, KVPlan(4, 64, 1, "given")))
    job = tmp_path / "job.yaml"
    job.write_text(f"target: {tiny_tok['target']}\nquantization: fp8\n")
    assert load_config(str(job)).engine_config().quantization == "fp8"


def test_a_batch_job_on_ray_with_fp8_target_and_draft_workers(ray_session, tiny_tok, fp8_refs, tmp_path, capsys):
    """Through the actors: the target in its engine worker, the draft in a proposer worker of its own
    (separate layout), both quantized at load."""
    from specray.entrypoints import jobs
    from tests.conftest import encode

    prompts, refs = fp8_refs
    config = tmp_path / "job.yaml"
    config.write_text(f"target: {tiny_tok['target']}\ndraft: {tiny_tok['draft']}\nquantization: fp8\n"
                      "draft_quantization: fp8\nmax_num_seqs: 4\nplacement:\n  mode: separate\n  timeout_s: 60\n")
    inp = tmp_path / "in.jsonl"
    spec = {"method": "draft", "num_speculative_tokens": 3}
    sampling = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    inp.write_text("".join(json.dumps({"prompt": encode(p), "sampling": sampling, "speculation": spec}) + "\n"
                           for p in prompts))
    out = tmp_path / "out.jsonl"
    assert jobs.main(["--input", str(inp), "--output", str(out), "--config", str(config)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [o["token_ids"] for o in lines] == refs
    assert sum(o["metrics"]["num_drafts"] for o in lines) > 0


# -- the demo pair -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_demo_pair_in_fp8_is_lossless_for_every_method(demo_pair, demo_models):
    """The trained pair with --quantization fp8: every method's greedy output equals the FP8
    target's plain decoding (and HF generate of the FP8 model), the draft in FP8 too; with the
    draft left in float (no --draft-quantization) the draft model's output is the same. Only the
    draft method reads the draft model, so the float draft runs it alone. Heads are random (they
    need not be good to be lossless)."""
    from specray.demo import held_out_prompts
    from tests.test_eagle import random_head
    from tests.test_eagle3 import random_head3
    from tests.test_medusa import random_heads
    from tests.test_redrafter import random_drafter

    target = demo_models[0]
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    heads = {"medusa": random_heads(hidden=hidden, vocab=vocab), "eagle": random_head(target),
             "redrafter": random_drafter(hidden=hidden, vocab=vocab), "eagle3": random_head3(target)}

    def engine(draft_quantization):
        # No profile: the budget drafts from the first steps whatever the machine's load.
        return LLMEngine(EngineConfig(target=demo_pair.target, draft=demo_pair.draft, tokenizer=demo_pair.tokenizer,
                                      max_num_seqs=4, quantization="fp8", draft_quantization=draft_quantization,
                                      profile_costs=False),
                         resources=heads)

    prompts = held_out_prompts(4, demo_pair.tokenizer)
    sampling = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    fp8_draft = engine("fp8")
    assert isinstance(fp8_draft.target.decoder.layers[0].mlp.down_proj, FP8Linear)
    assert any(isinstance(m, FP8Linear) for m in fp8_draft.resources["draft"].decoder.modules())
    plain = [o.token_ids for o in fp8_draft.generate(prompts, sampling, SpeculationParams(method="none"))]
    fp8_hf = copy.deepcopy(target)
    quantize_linears(fp8_hf)
    first = demo_models[2].encode(prompts[0], add_special_tokens=False)
    assert plain[0] == hf_greedy(fp8_hf, first, 24)
    for name, spec in SPECS.items():
        outs = fp8_draft.generate(prompts, sampling, SpeculationParams(**spec))
        assert [o.token_ids for o in outs] == plain, name
    float_draft = engine(None)
    assert isinstance(float_draft.target.decoder.layers[0].mlp.down_proj, FP8Linear)
    assert not any(isinstance(m, FP8Linear) for m in float_draft.resources["draft"].decoder.modules())
    outs = float_draft.generate(prompts, sampling, SpeculationParams(**SPECS["draft"]))
    assert [o.token_ids for o in outs] == plain and sum(o.metrics["num_drafts"] for o in outs) > 0
