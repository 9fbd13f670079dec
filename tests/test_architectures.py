"""The architecture matrix: every decoder the runner serves is token-identical to HF generate.

Tiny checkpoints built from transformers configs (random weights, no download), one per
served ``model_type``, each with a 1-layer draft of its own family and random Medusa heads:
greedy ``none`` / ``draft`` / ``ngram`` / ``medusa`` equal HF ``generate`` at batch 1 and at
batch 4 with ragged prompts. The configs exercise the conventions that differ between
families (GQA/MQA, attention biases, sliding windows smaller than the test's contexts,
tied embeddings, attention and final-logit soft-capping, partial/scaled/per-layer rotary,
learned positions, projected hidden states); ``test_matrix_covers_the_conventions`` checks
that each one is really present. Architectures the runner cannot serve exactly are refused
at load, by name.
"""

from __future__ import annotations

import copy
import functools
from unittest import mock
from dataclasses import dataclass, field

import pytest
import torch
import transformers

from specray.engine.architectures import SERVED_ARCHITECTURES, UnsupportedArchitectureError
from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.runner import ModelRunner
from specray.kernels import attention
from specray.kernels.tree import NAMED_TREES, build_tree
from tests.conftest import hf_greedy
from tests.test_engine import ragged_prompts
from tests.test_medusa import random_heads

VOCAB = 64
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ragged_prompts(6, vocab=VOCAB)  # 3 to 27 tokens: contexts reach 39, past every window below
METHODS = ["none", "draft", "ngram", "medusa"]
NO_SPECIALS = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
# Most families read these names; a large init keeps argmax margins far above float noise.
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, initializer_range=0.3)


@dataclass(frozen=True)
class Arch:
    config: str  # transformers config class
    model: str  # its causal LM class
    kwargs: dict = field(default_factory=dict)
    layers_key: str = "num_hidden_layers"

    def build(self, layers: int, seed: int):
        kwargs = dict(self.kwargs, **{self.layers_key: layers})
        if "layer_types" in kwargs:  # one per layer: the draft keeps the first
            kwargs["layer_types"] = kwargs["layer_types"][:layers]
        cfg = getattr(transformers, self.config)(**NO_SPECIALS, **kwargs)
        torch.manual_seed(seed)
        return getattr(transformers, self.model)(cfg).eval()


ARCHS = {
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", dict(LLAMA_LIKE, attention_bias=True)),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", dict(LLAMA_LIKE, num_key_value_heads=1, sliding_window=5)),
    # Sliding only from layer 1 on (max_window_layers), q/k/v biases, tied, YaRN rotary.
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", dict(
        LLAMA_LIKE, use_sliding_window=True, sliding_window=6, max_window_layers=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                         "original_max_position_embeddings": 128})),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", dict(
        LLAMA_LIKE, head_dim=16, attention_bias=True, use_sliding_window=True, sliding_window=4, max_window_layers=0,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    # Gemmas untied: tied random Gemma weights decode one token over and over, which would
    # make the comparison weak (tied embeddings are covered by qwen2, gpt2, gpt_bigcode, opt).
    "gemma": Arch("GemmaConfig", "GemmaForCausalLM", dict(LLAMA_LIKE, head_dim=16, num_key_value_heads=1,
                                                          tie_word_embeddings=False)),
    "gemma2": Arch("Gemma2Config", "Gemma2ForCausalLM", dict(
        LLAMA_LIKE, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        query_pre_attn_scalar=16, tie_word_embeddings=False)),
    # Sliding and global layers with different rotary bases.
    "gemma3_text": Arch("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        LLAMA_LIKE, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=3.0, tie_word_embeddings=False)),
    "phi": Arch("PhiConfig", "PhiForCausalLM", dict(LLAMA_LIKE, partial_rotary_factor=0.5)),
    "phi3": Arch("Phi3Config", "Phi3ForCausalLM", dict(LLAMA_LIKE, partial_rotary_factor=0.5, sliding_window=5)),
    "starcoder2": Arch("Starcoder2Config", "Starcoder2ForCausalLM", dict(LLAMA_LIKE, sliding_window=5)),
    "gpt2": Arch("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_head=4, n_positions=256, initializer_range=0.3,
                                                       scale_attn_by_inverse_layer_idx=True), "n_layer"),
    "gpt_bigcode": Arch("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        n_embd=32, n_head=4, n_positions=256, multi_query=True, initializer_range=0.3), "n_layer"),
    "gpt_neox": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=256, rotary_pct=0.25,
        initializer_range=0.3)),
    # Learned positions (offset 2) and hidden states projected 32 -> 16 before the LM head.
    "opt": Arch("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=32, ffn_dim=64, num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=16,
        init_std=0.3)),
}


@functools.lru_cache(maxsize=None)
def family(name: str):
    """(target with 2 layers, draft with 1, Medusa heads, HF greedy references for PROMPTS)."""
    arch = ARCHS[name]
    target, draft = arch.build(layers=2, seed=0), arch.build(layers=1, seed=1)
    heads = random_heads(hidden=target.get_output_embeddings().weight.shape[1], vocab=VOCAB)
    refs = [hf_greedy(target, p, GREEDY.max_tokens) for p in PROMPTS]
    return target, draft, heads, refs


def run(name: str, method: str, batch: int, prompts=PROMPTS):
    target, draft, heads, _ = family(name)
    engine = LLMEngine(
        EngineConfig(target="<in-memory>", max_num_seqs=batch),
        target_model=copy.deepcopy(target),  # the runner installs its attention; keep the HF copy clean
        draft_model=copy.deepcopy(draft) if method == "draft" else None,
        medusa_heads=heads if method == "medusa" else None,
    )
    spec = SpeculationParams(method=method) if method in ("none", "medusa") else \
        SpeculationParams(method=method, num_speculative_tokens=3)
    outs = engine.generate(prompts, GREEDY, spec)
    return [o.token_ids for o in outs], engine.totals


def test_every_served_architecture_is_in_the_matrix():
    assert set(ARCHS) == set(SERVED_ARCHITECTURES)
    for name in ARCHS:
        assert family(name)[0].config.model_type == name


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(ARCHS))
def test_greedy_equals_hf_generate(name, method, batch):
    refs = family(name)[3]
    prompts = PROMPTS if batch > 1 else PROMPTS[:2]  # 6 ragged prompts through 4 slots: joins mid-way
    got, totals = run(name, method, batch, prompts)
    assert got == refs[: len(prompts)]
    if method != "none":
        assert totals.num_drafts > 0


# -- the matrix really exercises each convention --------------------------------------------
def _features(name: str) -> set[str]:
    target = family(name)[0]
    cfg = target.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    found = {"gqa"} if 1 < kv < heads else {"mqa"} if kv == 1 else set()
    params = dict(target.named_parameters())
    if any(n.endswith("bias") and ("attn" in n or "attention" in n) for n in params):
        found.add("attention bias")
    context = max(len(p) for p in PROMPTS) + GREEDY.max_tokens
    windows, softcapped = _attention_calls(name)
    if any(w is not None and w < context for w in windows):
        found.add("sliding window")
        if None in windows:
            found.add("sliding and full layers")
    if softcapped:
        found.add("attention softcap")
    if target.get_output_embeddings().weight is target.get_input_embeddings().weight:
        found.add("tied embeddings")
    if getattr(cfg, "final_logit_softcapping", None):
        found.add("final logit softcap")
    rope = getattr(cfg, "rope_parameters", None) or {}
    flat = list(rope.values()) if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    if any(r.get("partial_rotary_factor", 1.0) < 1.0 for r in flat) or getattr(cfg, "rotary_pct", 1.0) < 1.0:
        found.add("partial rotary")
    if any(r.get("rope_type", "default") != "default" for r in flat):
        found.add("scaled rotary")
    if len({r.get("rope_theta") for r in flat}) > 1:
        found.add("per-layer rotary bases")
    if any(isinstance(m, torch.nn.Embedding) and m.num_embeddings >= 256 for m in target.modules()):
        found.add("learned positions")
    if target.get_output_embeddings().weight.shape[1] != cfg.hidden_size:
        found.add("projected hidden states")
    return found


@functools.lru_cache(maxsize=None)
def _attention_calls(name: str) -> tuple[list, bool]:
    """What the model's layers hand specray's attention in one forward: each layer's
    sliding_window, and whether any asked for soft-capped scores."""
    windows, softcapped = [], []
    mask_for, capped = attention.AttentionBatch.mask_for, attention.softcapped_attention

    def spy_window(self, window):
        windows.append(window)
        return mask_for(self, window)

    def spy_softcap(*args):
        softcapped.append(True)
        return capped(*args)

    with mock.patch.object(attention.AttentionBatch, "mask_for", spy_window), \
            mock.patch.object(attention, "softcapped_attention", spy_softcap):
        ModelRunner(copy.deepcopy(family(name)[0]), num_slots=1, capacity=64).forward([0], [[1, 2, 3]])
    return windows, bool(softcapped)


def test_references_are_not_degenerate():
    """A model that repeats one token would make token equality a weak check."""
    for name in ARCHS:
        refs = family(name)[3]
        assert sum(len(set(r)) for r in refs) / len(refs) >= 3, name


def test_matrix_covers_the_conventions():
    covered = {f: [n for n in ARCHS if f in _features(n)] for f in (
        "gqa", "mqa", "attention bias", "sliding window", "sliding and full layers", "tied embeddings",
        "attention softcap", "final logit softcap", "partial rotary", "scaled rotary", "per-layer rotary bases",
        "learned positions", "projected hidden states")}
    assert all(covered.values()), {f: n for f, n in covered.items() if not n}


# -- negative controls: the matrix catches a runner that drops a convention ------------------
SLIDING = ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "starcoder2"]


@pytest.mark.parametrize("name", SLIDING)
def test_ignoring_the_window_would_fail(name, monkeypatch):
    """A runner whose attention ignores ``sliding_window`` fails the matrix."""
    assert "sliding window" in _features(name)
    monkeypatch.setattr(attention.AttentionBatch, "mask_for", lambda self, window: self.mask)
    got, _ = run(name, "none", 4)
    assert got != family(name)[3]


def test_ignoring_attention_softcap_would_fail(monkeypatch):
    monkeypatch.setattr(attention, "softcapped_attention",
                        lambda q, k, v, mask, scaling, softcap: attention.sdpa_attention(q, k, v, mask, scaling))
    got, _ = run("gemma2", "none", 4)
    assert got != family("gemma2")[3]


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_tree_verification_with_sliding_windows_equals_sequential_paths(name):
    """Windows count positions, not cache slots: each tree node sees its own path's window."""
    ref = family(name)[0]
    runner = ModelRunner(copy.deepcopy(ref), num_slots=2, capacity=64)
    tree = build_tree(NAMED_TREES["trtllm_example"])
    prefixes = [list(range(1, 12)), [9, 8, 7]]
    runner.forward([1, 0], [p[:-1] for p in prefixes])
    g = torch.Generator().manual_seed(0)
    tokens = [[p[-1]] + torch.randint(0, VOCAB, (tree.size - 1,), generator=g).tolist() for p in prefixes]
    layout = (tree.mask[None].expand(2, -1, -1), tree.depth[None].expand(2, -1))
    out = runner.forward([1, 0], tokens, logits_at=torch.arange(tree.size)[None].expand(2, -1), layout=layout)
    for i, p in enumerate(prefixes):
        for j in range(tree.size):
            path, node = [], j
            while node >= 0:
                path.append(tokens[i][node])
                node = int(tree.parents[node])
            with torch.no_grad():
                expected = ref(torch.tensor([p[:-1] + path[::-1]])).logits[0, -1]
            torch.testing.assert_close(out.logits[i, j], expected, atol=1e-5, rtol=0)


# -- refused at load, by name -------------------------------------------------------------------
REFUSED = {
    "falcon": Arch("FalconConfig", "FalconForCausalLM", dict(hidden_size=32, num_attention_heads=4)),
    "falcon-alibi": Arch("FalconConfig", "FalconForCausalLM", dict(hidden_size=32, num_attention_heads=4, alibi=True)),
    "bloom": Arch("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_head=4), "n_layer"),
    "mpt": Arch("MptConfig", "MptForCausalLM", dict(d_model=32, n_heads=4), "n_layers"),
    "gptj": Arch("GPTJConfig", "GPTJForCausalLM", dict(n_embd=32, n_head=4, rotary_dim=4), "n_layer"),
    "cohere": Arch("CohereConfig", "CohereForCausalLM", dict(LLAMA_LIKE, logit_scale=0.5)),
    "granite": Arch("GraniteConfig", "GraniteForCausalLM", dict(LLAMA_LIKE, logits_scaling=2.0)),
    "stablelm": Arch("StableLmConfig", "StableLmForCausalLM", dict(LLAMA_LIKE)),
    "olmo2": Arch("Olmo2Config", "Olmo2ForCausalLM", dict(LLAMA_LIKE)),  # never compared: refused too
}


@pytest.mark.parametrize("label", list(REFUSED))
def test_unserved_architectures_are_refused_by_name(label):
    model = REFUSED[label].build(layers=1, seed=0)
    model_type = model.config.model_type
    with pytest.raises(UnsupportedArchitectureError, match=f"'{model_type}'"):
        ModelRunner(model, num_slots=1, capacity=32)


def test_refused_checkpoint_fails_before_its_weights_load(tmp_path):
    REFUSED["falcon"].build(layers=1, seed=0).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # never read
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'.*AttentionInterface"):
        LLMEngine(EngineConfig(target=str(tmp_path), max_num_seqs=1))


def test_longrope_is_served_only_within_its_original_context():
    arch = Arch("Phi3Config", "Phi3ForCausalLM", dict(
        LLAMA_LIKE, original_max_position_embeddings=32, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                     "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
                                     "original_max_position_embeddings": 32}))
    model = arch.build(layers=1, seed=0)
    with pytest.raises(UnsupportedArchitectureError, match="'phi3'.*longrope.*max_model_len <= 32"):
        ModelRunner(copy.deepcopy(model), num_slots=1, capacity=64)
    runner = ModelRunner(copy.deepcopy(model), num_slots=1, capacity=32)
    prompt = list(range(1, 20))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(runner.forward([0], [prompt]).logits[0, 0], expected, atol=1e-5, rtol=0)
