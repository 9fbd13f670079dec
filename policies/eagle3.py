"""EAGLE-3: a token-level draft head on three of the target's layers, self-fed from its
second step, with its own reduced vocabulary.

The head (EAGLE-3; Li et al. 2025), as SafeAILab/EAGLE trains it and vLLM/SGLang serve it:

* the target's residual stream entering three decoder layers (low, middle, high; by default
  layers 2, L//2 and L-3 of an L-layer target, SGLang's and vLLM's convention) at position t
  is fused by ``fc`` (3H -> H, no bias) into g_t;
* one decoder layer (``midlayer``) reads the pair (g_t, x_{t+1}): its q/k/v project the 2H-wide
  ``[input_layernorm(embed(x_{t+1})); hidden_norm(g_t)]``, its residual stream is g_t, and
  its output h_t (before ``norm``) is both what the head feeds itself at the next depth and,
  through ``norm`` and ``lm_head``, the logits of x_{t+2} over the draft vocabulary;
* draft token i is target token ``i + d2t[i]``; ``t2d`` marks the target tokens the draft
  vocabulary holds. Logits are scattered into the target's vocabulary with -inf elsewhere,
  so every distribution the tree code sees is over the target's tokens and gives tokens
  outside the draft vocabulary q = 0.

There is no feature regression: where EAGLE-1 feeds its prediction of the target's next
feature, EAGLE-3 feeds its own hidden state h, as it was trained ("training-time test").
Committed positions always get the target's true taps (``CommitRow.features`` carries the
three layers, concatenated: ``MethodSpec.feature_layers``).

Drafting is EAGLE's (``policies/eagle.py``: the same proposer, catch-up, level-by-level
expansion under an ancestor mask, static trees, EAGLE-2 dynamic trees and chains, and the
same sampled-node rule); only the head differs.

Checkpoints are the public EAGLE-3 layout (SafeAILab/EAGLE, read by SGLang and vLLM):
``config.json`` with ``architectures`` ``LlamaForCausalLMEagle3`` (SGLang) or
``LlamaForCausalLM`` (SafeAILab), ``draft_vocab_size``, optional ``norm_before_residual`` and
layer ids; tensors ``fc.weight``, ``midlayer.*`` (with
``hidden_norm``), ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d`` (and optionally
``embed_tokens.weight``), in ``model.safetensors`` or ``pytorch_model.bin``.
"""

from __future__ import annotations

import pathlib
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from specray.policies.checkpoint_files import building
from specray.policies.eagle import (
    EagleOptions, EagleProposer, _check, _offline_facts, head_runner, llama_config, read_extras, read_head_config,
    read_head_weights, write_head_dir,
)
from specray.policies.registry import MethodSpec, register_method

NUM_TAPS = 3


class Eagle3Options(EagleOptions):
    """EAGLE-3 with EAGLE's tree options: EAGLE-2's dynamic tree (the default, as EAGLE-3's
    reference code drafts), a static tree (``dynamic_tree: false``: the one fitted with the
    head; or ``eagle_choices``/``tree``, which imply it) or a chain (``tree: chain``).

    The dynamic tree is the default because it is what EAGLE-3 was built and measured with (its
    reference drafts EAGLE-2's tree; SGLang's EAGLE-3 with top-k > 1 does the same), and the
    self-tuning length drafts it whole or its best node alone as it pays."""

    method: Literal["eagle3"] = "eagle3"
    dynamic_tree: bool = Field(True, description="EAGLE-2's dynamic tree (top_k, depth, total_tokens); false: static.")

    @model_validator(mode="before")
    @classmethod
    def _static_when_a_tree_is_given(cls, data):
        # A static tree named (eagle_choices/tree) asks for a static tree: no dynamic_tree needed.
        if isinstance(data, dict) and "dynamic_tree" not in data and (
                data.get("eagle_choices") is not None or data.get("tree") is not None):
            data = {**data, "dynamic_tree": False}
        return data


# -- which target layers ---------------------------------------------------------------------
def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high taps: the inputs of layers 2, L//2 and L-3."""
    return (2, num_layers // 2, num_layers - 3)


def configured_layers(raw: dict) -> tuple[int, ...] | None:
    """Layer ids a checkpoint's config.json names, as inputs of decoder layers, or None.

    vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` as capture slots (the input
    of layer k), unless ``eagle_aux_layer_semantics: sglang``; SGLang reads
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` as layer *outputs* (the input of layer
    k + 1). Both are honoured."""
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:
        shift = 1 if raw.get("eagle_aux_layer_semantics") == "sglang" else 0
        return tuple(int(k) + shift for k in top)
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return tuple(int(k) + 1 for k in nested)
    return None


# -- the head ----------------------------------------------------------------------------------
class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer``: a Llama layer whose attention reads [norm(embedding); norm(g)].

    ``pair_input`` tells the runner it may run the layer unrolled (``engine/llama_layers.py``:
    the same operations as ``forward``, without its dozen module calls)."""

    pair_input = True

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx=0)
        bias = bool(getattr(config, "attention_bias", False))
        for name in ("q_proj", "k_proj", "v_proj"):  # 2H-wide input
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * hidden, old.out_features, bias=bias))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        # Some trainers (e.g. the Speculators format) add the normed g to the residual stream.
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def inputs(self, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pairs [.., 2H] = [embedding ; g] -> (attention input [.., 2H], residual [.., H])."""
        emb, g = pairs.chunk(2, dim=-1)
        normed = self.hidden_norm(g)
        return torch.cat([self.input_layernorm(emb), normed], dim=-1), normed if self.norm_before_residual else g

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention: h [.., H]."""
        h = residual + attended
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, position_ids=None, **kwargs):
        x, residual = self.inputs(hidden_states)  # [B, q, 2H], [B, q, H]
        attended, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                                     position_embeddings=position_embeddings, **kwargs)
        return self.finish(residual, attended)


class _Decoder:
    """The decoder surface a ``ModelRunner`` drives: its output is h, before ``norm``
    (what the head feeds itself); ``norm`` and the LM head are applied by ``_VocabHead``."""

    def __init__(self, head: "Eagle3Head"):
        self.embed_tokens, self.rotary_emb = head.embed_tokens, head.rotary_emb
        self.layers, self.norm = [head.midlayer], nn.Identity()


class _VocabHead:
    """norm -> lm_head over the draft vocabulary -> scattered into the target's (-inf elsewhere)."""

    def __init__(self, head: "Eagle3Head"):
        self.head = head
        self.weight, self.in_features = head.lm_head.weight, head.lm_head.in_features

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [.., H] -> [.., V]
        return self.head.target_logits(self.head.lm_head(self.head.norm(h)))


class Eagle3Head(nn.Module):
    """fc + midlayer + norm + a reduced-vocabulary LM head; the target's embedding is bound.

    Parameters carry the public names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``; buffers
    ``d2t``, ``t2d``). ``layer_ids`` are the target layers whose inputs it reads (resolved
    against the target's depth by ``bind``)."""

    def __init__(self, config, vocab_size: int | None = None):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.config = config
        hidden = config.hidden_size
        self.vocab_size = vocab_size or config.vocab_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or self.vocab_size
        self.fc = nn.Linear(NUM_TAPS * hidden, hidden, bias=bool(getattr(config, "bias", False)))
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        # draft token i is target token i + d2t[i]; t2d[v]: target token v is in the draft vocab
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(self.vocab_size, dtype=torch.bool))
        self.set_vocab(torch.arange(min(self.draft_vocab_size, self.vocab_size)))
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.choices: list[list[int]] | None = None  # the fitted default tree (as EagleHead's)
        self.greedy_temperature = 1.0  # EAGLE-2 confidence for greedy rows (see EagleHead)
        self.configured_layers: tuple[int, ...] | None = None  # from config.json, if it names them
        self.layer_ids: tuple[int, ...] = ()
        self._embed: tuple = ()  # the target's token embedding: bound, not a parameter

    # -- vocabulary --------------------------------------------------------------------------
    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``target_ids`` [draft_vocab_size] increasing target token ids."""
        ids = target_ids.to(self.d2t.device, torch.long)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:  # [Vd] the target token of each draft token
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[.., Vd] -> [.., V]: -inf outside the draft vocabulary (q = 0 there)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.target_ids] = draft_logits
        return out

    # -- the surface a ModelRunner reads ----------------------------------------------------------
    @property
    def embed_tokens(self):
        return self._embed[0]

    def get_decoder(self):
        return _Decoder(self)

    def get_output_embeddings(self):
        return _VocabHead(self)

    def set_attn_implementation(self, name: str) -> None:
        self.config._attn_implementation = name

    def bind(self, embed_tokens: nn.Module, num_layers: int) -> "Eagle3Head":
        """Use the target's (frozen) token embedding; resolve the taps against its depth."""
        if embed_tokens.weight.shape != (self.vocab_size, self.config.hidden_size):
            raise ValueError(f"the EAGLE-3 head has vocabulary x hidden {self.vocab_size} x {self.config.hidden_size}, "
                             f"the target's embedding {tuple(embed_tokens.weight.shape)}")
        self._embed, self.layer_ids = (embed_tokens,), self.taps(num_layers)
        return self

    def taps(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose inputs the head reads, for a target of ``num_layers``."""
        layers = self.configured_layers or default_layers(num_layers)
        if len(layers) != NUM_TAPS or not all(0 <= k < num_layers for k in layers):
            raise ValueError(f"EAGLE-3 reads {NUM_TAPS} target layers in 0..{num_layers - 1}; got {list(layers)} "
                             f"(a target this shallow needs eagle_aux_hidden_state_layer_ids in the head's config)")
        return tuple(layers)

    # -- inputs -----------------------------------------------------------------------------------
    def fuse_target(self, tokens: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """Pairs from the target's taps [.., 3 Ht] and tokens [..]: [.., 2H] = [embed; fc(taps)]."""
        return self.fuse(tokens, self.fc(taps))

    def target_features(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's taps [.., 3 Ht] as ``fuse`` reads them: g = fc(taps) [.., H]."""
        return self.fc(taps)

    def fuse(self, tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Pairs from the head's own h (or fused g) [.., H] and tokens [..]: [.., 2H]."""
        return torch.cat([self.embed_tokens(tokens).to(g.dtype), g], dim=-1)

    # -- training and tests: the training-time test, unrolled ----------------------------------------
    def unrolled(self, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """h of ``steps`` self-fed passes over a batch of sequences: [B, T, H] per step.

        Step 0 reads the pairs (g_t, x_{t+1}) (``tokens[:, t]`` = x_{t+1}, ``taps[:, t]`` the
        target's taps at t) under a causal mask: h_0[t] predicts x_{t+2}. Step j reads
        (h_{j-1}[t], x_{t+j+1}) at position t + j and attends to step 0's keys at positions
        <= t and to the keys of steps 1..j at t — exactly the chain drafted from root
        x_{t+1} at inference (committed pairs, then one node per depth): h_j[t] predicts
        x_{t+j+2}. Tokens past the end are 0 (those positions are for the caller to mask).
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        attn, layer = self.midlayer.self_attn, self.midlayer
        batch, length = tokens.shape
        groups = attn.num_key_value_groups
        causal = torch.full((length, length), float("-inf"), device=tokens.device).triu(1)  # [T, T]
        g = self.fc(taps)  # [B, T, H]
        keys, values, out = [], [], []
        for step in range(steps):
            shifted = torch.cat([tokens[:, step:], tokens.new_zeros(batch, min(step, length))], dim=1)  # [B, T]
            x, residual = layer.inputs(self.fuse(shifted, g))
            pos = (torch.arange(length, device=tokens.device) + step)[None].expand(batch, -1)
            shape = (batch, length, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, heads, T, d]
            k = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, kv heads, T, d]
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            cos, sin = self.rotary_emb(x, position_ids=pos)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys.append(repeat_kv(k, groups))
            values.append(repeat_kv(v, groups))
            scores = [(q @ keys[0].transpose(2, 3)) * attn.scaling + causal.to(q.dtype)]  # [B, heads, T, T]
            scores += [((q * kk).sum(-1) * attn.scaling)[..., None] for kk in keys[1:]]  # [B, heads, T, 1] each
            probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
            mixed = probs[..., :length] @ values[0]
            for i, vv in enumerate(values[1:]):
                mixed = mixed + probs[..., length + i, None] * vv
            attended = attn.o_proj(mixed.transpose(1, 2).reshape(batch, length, -1))
            g = layer.finish(residual, attended)
            out.append(g)
        return out

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] -> [.., Vd] logits over the draft vocabulary."""
        return self.lm_head(self.norm(h))

    # -- the public checkpoint layout ---------------------------------------------------------------
    def save(self, directory: str | pathlib.Path, base_model: str | None = None) -> None:
        cfg = self.config.to_dict()
        cfg.update({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "vocab_size": self.vocab_size,
                    "draft_vocab_size": self.draft_vocab_size, "tie_word_embeddings": False,
                    "base_model_name_or_path": base_model})
        rope = cfg.get("rope_parameters") or {}
        if "rope_theta" in rope:  # readers older than transformers 5 look for rope_theta
            cfg.setdefault("rope_theta", rope["rope_theta"])
        if self.configured_layers is not None:  # both readers' spellings (see configured_layers)
            cfg["eagle_aux_hidden_state_layer_ids"] = list(self.configured_layers)
            if min(self.configured_layers) >= 1:
                cfg["eagle_config"] = {"use_aux_hidden_state": True,
                                       "eagle_aux_hidden_state_layer_ids": [k - 1 for k in self.configured_layers]}
        write_head_dir(directory, cfg, dict(self.state_dict()), self)

    @classmethod
    def load(cls, directory: str | pathlib.Path, hidden_size: int | None = None,
             vocab_size: int | None = None, described: bool = False) -> "Eagle3Head":
        """A head from the public layout; ``hidden_size``/``vocab_size``: the target's, checked
        (``described``: only checked, see checkpoint_files)."""
        raw, cfg_file = read_head_config(directory, "EAGLE-3 head")
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"{cfg_file}: num_hidden_layers {raw['num_hidden_layers']}: specray serves one-layer "
                             f"EAGLE-3 heads")
        width = raw.get("target_hidden_size") or raw["hidden_size"]
        if width != raw["hidden_size"]:  # the target's embedding feeds the head: one width
            raise ValueError(f"{cfg_file}: target_hidden_size {width} differs from hidden_size {raw['hidden_size']}: "
                             f"specray serves EAGLE-3 heads as wide as their target")
        if hidden_size is not None and width != hidden_size:
            raise ValueError(f"the EAGLE-3 head has hidden size {width}, the target {hidden_size}")
        vocab = raw.get("vocab_size") or vocab_size
        if vocab is None or vocab_size is not None and vocab != vocab_size:
            raise ValueError(f"the EAGLE-3 head maps to a vocabulary of {vocab}, the target has {vocab_size}")
        state, weights = read_head_weights(directory, described)
        state.pop("embed_tokens.weight", None)  # SGLang's rule: the target's embedding serves
        t2d, d2t = state.pop("t2d", None), state.pop("d2t", None)
        with building(described):
            head = cls(llama_config(raw, drop=()), vocab)
        if d2t is None and head.draft_vocab_size != vocab:
            raise ValueError(f"{weights}: a draft vocabulary of {head.draft_vocab_size} < {vocab} needs d2t")
        try:
            missing, unexpected = head.load_state_dict(state, strict=False, assign=described)  # d2t/t2d: below
        except RuntimeError as exc:  # shapes
            raise ValueError(f"{weights} does not match a one-layer EAGLE-3 head of {cfg_file}: {exc}") from None
        missing = [k for k in missing if k not in ("d2t", "t2d")]
        if missing or unexpected:
            raise ValueError(f"{weights} does not match a one-layer EAGLE-3 head of {cfg_file}: missing {missing[:6]}, "
                             f"unexpected {unexpected[:6]}")
        if d2t is not None:
            ids = d2t.long() + torch.arange(len(d2t))
            if len(d2t) != head.draft_vocab_size or ids.min() < 0 or ids.max() >= vocab or (ids.diff() <= 0).any():
                raise ValueError(f"{weights}: d2t must map {head.draft_vocab_size} draft tokens to distinct, increasing "
                                 f"target tokens below {vocab}")
            head.set_vocab(ids)
            if t2d is not None and not torch.equal(t2d.bool(), torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)):
                raise ValueError(f"{weights}: t2d disagrees with d2t")
        head.configured_layers = configured_layers(raw)
        read_extras(head, raw, cfg_file)
        return head.eval()


# -- the spec ----------------------------------------------------------------------------------
def _bind(head: Eagle3Head, ctx) -> Eagle3Head:
    return ctx.place(head.bind(ctx.target.decoder.embed_tokens, ctx.target.num_layers))


def _build(ctx) -> EagleProposer:
    head = _bind(ctx.resource, ctx)  # in-memory heads too: the target's dtype, device and depth
    return EagleProposer(head, head_runner(ctx, head), ctx.vocab_size)


def _inspect(path: str, target) -> dict:
    """The head's layout against the target: widths, vocabulary map, the layers it taps."""
    Eagle3Head.load(path, target.hidden_size, target.vocab_size, described=True).taps(target.num_layers)
    return {}


def _load(path: str, ctx) -> Eagle3Head:
    return _bind(Eagle3Head.load(path, hidden_size=ctx.target.hidden_size, vocab_size=ctx.vocab_size), ctx)


register_method(MethodSpec(
    name="eagle3",
    options=Eagle3Options,
    build=_build,
    needs_features=True,
    drafts_trees=True,
    placement="target",
    checkpoint="eagle3",
    recipe="specray.training.eagle3",
    requirement="an EAGLE-3 head (EngineConfig.checkpoints['eagle3'] / --eagle3 DIR; `specray train eagle3`)",
    load=_load,
    facts=lambda head: {"hidden_size": head.config.hidden_size, "choices": head.choices},
    offline_facts=_offline_facts,
    check=_check,
    feature_layers=lambda head: head.layer_ids,
    inspect=_inspect,
))

