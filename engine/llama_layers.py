"""Llama decoder layers run without their module wrappers: the same operations, in the same
order, as transformers' ``LlamaDecoderLayer`` (so the output is bitwise equal), minus what a
layer call costs around them.

Per layer, transformers calls 13 modules (two norms, seven projections, the attention and MLP
blocks, the activation), two deprecation wrappers and an attention-function lookup; on a small
model each call costs as much as the arithmetic it wraps (``python -m specray.bench.kv``'s
cached-prefix time to first token, a short forward, shows the difference). The weights are read once when the runner is built: they are held in
place (hot swaps copy into them, as CUDA graphs need), so the references stay valid.

Eager and uncompiled fixed-shape forwards use them; compiled forwards keep transformers'
layers (a graph has no module calls to save, and dynamo compiled the unrolled ones far
more slowly, seen on the demo target).
Only layers that are exactly transformers' Llama layer are unrolled (plain ``nn.Linear``
projections, SiLU, RMSNorm, the specray attention), and EAGLE-3's ``midlayer``, a Llama layer
whose attention reads [norm(embedding); norm(g)] (a layer that says so with ``pair_input``:
``policies/eagle3.py``; an EAGLE-3 step runs it once per tree level); anything else — sharded,
quantized, another architecture — keeps its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specray.kernels.attention import ATTENTION_NAME, cached_attention


@dataclass(frozen=True)
class _Layer:
    attn: nn.Module  # passed to the attention function (its layer_idx, GQA groups)
    norms: tuple  # (input weight, eps, post-attention weight, eps)
    qkvo: tuple  # (weight, bias) x 4
    mlp: tuple  # gate, up, down: (weight, bias) x 3
    head_dim: int
    scaling: float
    pair: tuple | None = None  # EAGLE-3's pair input: (hidden_norm weight, eps, norm_before_residual)


def unrolled(decoder) -> list[_Layer] | None:
    """The decoder's layers as ``run_layer`` reads them, or None if any layer is not exactly a
    transformers Llama layer in eval mode with specray's attention."""
    try:
        from transformers.activations import SiLUActivation
        from transformers.models.llama import modeling_llama as m
    except ImportError:  # noqa: BLE001 - an older or trimmed transformers: keep the modules
        return None
    out = []
    for layer in decoder.layers:
        a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        pair = getattr(layer, "pair_input", False)
        if pair:
            norms += (getattr(layer, "hidden_norm", None),)
        if ((type(layer) is not m.LlamaDecoderLayer and not pair) or type(a) is not m.LlamaAttention
                or type(mlp) is not m.LlamaMLP or any(type(n) is not m.LlamaRMSNorm for n in norms)
                or type(mlp.act_fn) is not SiLUActivation or layer.training
                or a.config._attn_implementation != ATTENTION_NAME):
            return None
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(p) is not nn.Linear for p in linears):
            return None
        pairs = tuple((p.weight, p.bias) for p in linears)
        widened = (norms[2].weight, norms[2].variance_epsilon, bool(layer.norm_before_residual)) if pair else None
        out.append(_Layer(a, (norms[0].weight, norms[0].variance_epsilon, norms[1].weight, norms[1].variance_epsilon),
                          pairs[:4], pairs[4:], a.head_dim, a.scaling, widened))
    return out


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # LlamaRMSNorm.forward
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def run_layer(layer: _Layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
    """One decoder layer: hidden [B, q, H] -> [B, q, H]; cos/sin from the decoder's rotary
    embedding; ctx the forward's ``AttentionBatch``. An EAGLE-3 layer reads hidden [B, q, 2H],
    the pairs [embedding; g]."""
    (q_w, q_b), (k_w, k_b), (v_w, v_b), (o_w, o_b) = layer.qkvo
    (g_w, g_b), (u_w, u_b), (d_w, d_b) = layer.mlp
    in_w, in_eps, post_w, post_eps = layer.norms
    if layer.pair is None:
        residual = hidden
        x = _rms(hidden, in_w, in_eps)
    else:  # Eagle3Layer.inputs
        hn_w, hn_eps, norm_before_residual = layer.pair
        emb, g = hidden.chunk(2, dim=-1)
        normed = _rms(g, hn_w, hn_eps)
        x = torch.cat([_rms(emb, in_w, in_eps), normed], dim=-1)
        residual = normed if norm_before_residual else g
    shape = (*x.shape[:-1], -1, layer.head_dim)
    q = F.linear(x, q_w, q_b).view(shape).transpose(1, 2)
    k = F.linear(x, k_w, k_b).view(shape).transpose(1, 2)
    v = F.linear(x, v_w, v_b).view(shape).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    out, _ = cached_attention(layer.attn, q, k, v, None, dropout=0.0, scaling=layer.scaling, specray_batch=ctx)
    out = out.reshape(*x.shape[:-1], -1).contiguous()
    hidden = residual + F.linear(out, o_w, o_b)
    residual = hidden
    x = _rms(hidden, post_w, post_eps)
    x = F.linear(F.silu(F.linear(x, g_w, g_b)) * F.linear(x, u_w, u_b), d_w, d_b)
    return residual + x
