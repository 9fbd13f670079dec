"""Megatron's split of a decoder over a tensor-parallel group, applied to a model from outside.

The model's code knows nothing of ranks: each rank loads the same checkpoint, and
``shard_model`` cuts every decoder layer's projections to that rank's share by a plan per
architecture (``PLANS``) — the split that Megatron-LM, vLLM and transformers' ``tp_plan``
apply to these decoders:

    q/k/v (and fused qkv)   column-parallel by heads: rank r keeps query heads
                            [r*H/N, (r+1)*H/N) and their KV heads; with fewer KV heads than
                            ranks each KV head is replicated on the N/H_kv ranks it serves
    gate/up, fc1            column-parallel: an equal share of the intermediate features
    o, down, fc2            row-parallel: the matching input columns, then one all-reduce
                            (the layer's bias added once, after it)

Everything else is replicated: norms, rotary tables, learned positions, the embedding (every
rank embeds its inputs) and the LM head, which only rank 0 computes (its hidden states are
whole after the last all-reduce; the other ranks' runners skip it). The attention function
is specray's own and reads head counts from the tensors it is given, so the KV cache of a
rank holds only its KV heads (``ShardInfo.kv_heads``).

transformers' ``tp_plan`` was the first choice: it shards these same modules, but through
DTensor at load time (``from_pretrained(tp_plan=...)`` on a device mesh over the world
group), refuses KV heads that do not divide by the ranks (Mistral-style 1 KV head, MQA), and
covers only some of the served families (no plan for GPT-2, GPT-BigCode or OPT). Splitting
plain ``nn.Linear`` weights by index keeps the modules local tensors that specray's runner,
cache and graphs already serve.

A checkpoint that cannot be split (heads or features not divisible by the size, a layer
with a projection no rule covers, an architecture without a plan) is refused with the reason
before any weights load (``check_tensor_parallel``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from specray.engine.collectives import Groups
from specray.engine.quantization import FP8Linear


class TensorParallelError(ValueError):
    """A checkpoint that cannot be split over the requested number of ranks (the reason says why)."""


Part = Literal["q", "kv", "ff"]


@dataclass(frozen=True)
class Column:
    """Column-parallel: this rank keeps some output features. ``parts`` lays the output out:
    one part, or several concatenated (a fused qkv); ``per_head``: each head's q, k and v sit
    together, [heads, 3, head_dim] (GPT-NeoX, multi-head GPT-BigCode)."""

    parts: tuple[Part, ...]
    per_head: bool = False


@dataclass(frozen=True)
class Row:
    """Row-parallel: this rank keeps the input features its ``part`` produced (q heads for
    the attention output, ff for the MLP's), and the outputs are summed over the ranks."""

    part: Part


@dataclass(frozen=True)
class Plan:
    """How one architecture's decoder layers split: module path (in a layer) -> rule, and the
    attention module's attributes that hold head counts (set to this rank's)."""

    rules: dict[str, Column | Row]
    attention: str
    ff_size: tuple[str, ...] = ("intermediate_size",)  # config keys of the MLP width, first found
    # attention attribute -> what it holds: "q" heads, "kv" heads, "q_width" (q heads x head_dim),
    # "kv_width"; "config" = a copy of the config with this rank's head counts (Phi-3 reads them there)
    attrs: dict[str, str] = field(default_factory=dict)


_QKV = {"q_proj": Column(("q",)), "k_proj": Column(("kv",)), "v_proj": Column(("kv",))}
_GATED = {"mlp.gate_proj": Column(("ff",)), "mlp.up_proj": Column(("ff",)), "mlp.down_proj": Row("ff")}


def _attn(prefix: str, out: str, **extra) -> dict:
    return {**{f"{prefix}.{k}": v for k, v in _QKV.items()}, f"{prefix}.{out}": Row("q"), **extra}


_LLAMA = Plan({**_attn("self_attn", "o_proj"), **_GATED}, "self_attn")
PLANS: dict[str, Plan] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma": _LLAMA,
    "gemma2": _LLAMA,
    "gemma3_text": _LLAMA,
    "starcoder2": Plan({**_attn("self_attn", "o_proj"), "mlp.c_fc": Column(("ff",)), "mlp.c_proj": Row("ff")},
                       "self_attn"),
    "phi": Plan({**_attn("self_attn", "dense"), "mlp.fc1": Column(("ff",)), "mlp.fc2": Row("ff")}, "self_attn"),
    "phi3": Plan({"self_attn.qkv_proj": Column(("q", "kv", "kv")), "self_attn.o_proj": Row("q"),
                  "mlp.gate_up_proj": Column(("ff", "ff")), "mlp.down_proj": Row("ff")}, "self_attn",
                 attrs={"num_key_value_heads": "kv", "config": "config"}),
    "opt": Plan({**_attn("self_attn", "out_proj"), "fc1": Column(("ff",)), "fc2": Row("ff")}, "self_attn",
                ff_size=("ffn_dim",), attrs={"num_heads": "q", "embed_dim": "q_width"}),
    "gpt2": Plan({"attn.c_attn": Column(("q", "kv", "kv")), "attn.c_proj": Row("q"), "mlp.c_fc": Column(("ff",)),
                  "mlp.c_proj": Row("ff")}, "attn", ff_size=("n_inner",),
                 attrs={"num_heads": "q", "split_size": "q_width", "embed_dim": "q_width"}),
    "gpt_neox": Plan({"attention.query_key_value": Column(("q", "kv", "kv"), per_head=True),
                      "attention.dense": Row("q"), "mlp.dense_h_to_4h": Column(("ff",)),
                      "mlp.dense_4h_to_h": Row("ff")}, "attention"),
}
_BIGCODE = {"attn.c_proj": Row("q"), "mlp.c_fc": Column(("ff",)), "mlp.c_proj": Row("ff")}


def plan_for(config) -> Plan:
    """The architecture's plan (GPT-BigCode's depends on multi-query), or TensorParallelError."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gpt_bigcode":
        multi = getattr(config, "multi_query", True)
        # Multi-query: [q | k | v] with one KV head (replicated); multi-head: per head [q, k, v].
        qkv = Column(("q", "kv", "kv")) if multi else Column(("q", "kv", "kv"), per_head=True)
        return Plan({"attn.c_attn": qkv, **_BIGCODE}, "attn", ff_size=("n_inner",),
                    attrs={"num_heads": "q", "embed_dim": "q_width", "kv_heads": "kv", "kv_dim": "kv_width"})
    if model_type not in PLANS:
        raise TensorParallelError(f"architecture {model_type!r} has no tensor-parallel plan "
                                  f"(planned: {', '.join(sorted([*PLANS, 'gpt_bigcode']))})")
    return PLANS[model_type]


@dataclass(frozen=True)
class ShardInfo:
    """What this rank holds: its query and KV heads per layer (the KV cache's width)."""

    rank: int
    size: int
    q_heads: int
    kv_heads: int


@dataclass(frozen=True)
class _Shape:
    heads: int
    kv_heads: int
    head_dim: int
    ff: int


def _shape(config) -> _Shape:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    plan = plan_for(text)
    ff = next((getattr(text, k) for k in plan.ff_size if getattr(text, k, None)), None) or 4 * text.hidden_size
    return _Shape(heads, kv, head_dim, ff)


def check_tensor_parallel(config, size: int) -> ShardInfo:
    """The split of rank 0 for a model config over ``size`` ranks, or TensorParallelError with
    the reason (before any weights load)."""
    if size < 1:
        raise TensorParallelError(f"tensor_parallel_size must be >= 1, got {size}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(text, "model_type", type(text).__name__)
    shape = _shape(text)
    if shape.heads % size:
        raise TensorParallelError(f"{name}: {shape.heads} attention heads do not divide over {size} ranks")
    if shape.kv_heads % size and size % shape.kv_heads:
        raise TensorParallelError(f"{name}: {shape.kv_heads} KV heads neither divide over {size} ranks nor "
                                  f"replicate evenly on them")
    if shape.ff % size:
        raise TensorParallelError(f"{name}: an MLP width of {shape.ff} does not divide over {size} ranks")
    # KV heads that divide: each rank's query heads are whole KV groups; replicated ones: the
    # rank's query heads all read the one KV head it holds (size / kv_heads ranks per head).
    return ShardInfo(0, size, shape.heads // size, max(1, shape.kv_heads // size))


def check_splits(config) -> None:
    """The checkpoints an ``EngineConfig`` splits (the target, and the draft when
    draft_tensor_parallel_size > 1) checked from their configs: TensorParallelError naming the
    checkpoint and the reason, before anything is reserved or loaded."""
    if config.tensor_parallel_size == 1:
        return
    from transformers import AutoConfig

    paths = {"target": config.target}
    if config.draft_tensor_parallel_size > 1:
        if config.draft is None:
            raise TensorParallelError("draft_tensor_parallel_size > 1 splits a draft model, but none is loaded")
        paths["draft"] = config.draft
    for role, path in paths.items():
        if path is None:
            continue
        try:
            check_tensor_parallel(AutoConfig.from_pretrained(path), config.tensor_parallel_size)
        except TensorParallelError as exc:
            raise TensorParallelError(f"tensor_parallel_size {config.tensor_parallel_size}: the {role} ({path}) "
                                      f"cannot be split: {exc}") from None


# -- which output features a rank keeps ------------------------------------------------------
def _heads(count: int, head_dim: int, rank: int, size: int, block: int | None = None) -> torch.Tensor:
    """Indices of this rank's heads' features among ``count`` heads of ``block`` features each
    (default head_dim): an equal share, or the one head it serves when heads < ranks."""
    block = block or head_dim
    if count >= size:
        per = count // size
        chosen = range(rank * per, (rank + 1) * per)
    else:  # replicated: ranks r*count//size .. serve head r*count//size
        chosen = [rank * count // size]
    return torch.cat([torch.arange(h * block, (h + 1) * block) for h in chosen])


def _part(part: Part, shape: _Shape, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """(this rank's indices within the part, the part's whole width)."""
    if part == "q":
        return _heads(shape.heads, shape.head_dim, rank, size), shape.heads * shape.head_dim
    if part == "kv":
        return _heads(shape.kv_heads, shape.head_dim, rank, size), shape.kv_heads * shape.head_dim
    per = shape.ff // size
    return torch.arange(rank * per, (rank + 1) * per), shape.ff


def column_indices(rule: Column, shape: _Shape, rank: int, size: int) -> torch.Tensor:
    if rule.per_head:  # [heads, len(parts) * head_dim]: whole heads (q, k, v together)
        return _heads(shape.heads, shape.head_dim, rank, size, block=len(rule.parts) * shape.head_dim)
    out, offset = [], 0
    for part in rule.parts:
        idx, width = _part(part, shape, rank, size)
        out.append(idx + offset)
        offset += width
    return torch.cat(out)


# -- the split modules ------------------------------------------------------------------------
def _is_conv1d(module) -> bool:  # GPT-2's Conv1D: weight [in, out], x @ W + b
    return type(module).__name__ == "Conv1D"


def _is_projection(module) -> bool:
    return isinstance(module, (nn.Linear, FP8Linear)) or _is_conv1d(module)


def _fp8_scale(module: FP8Linear, idx: torch.Tensor | None) -> torch.Tensor:
    """An FP8 layer's scale for this rank's output rows ``idx`` (None: all rows). Per-tensor and
    per-channel scales split with the rows; block scales would need the split on tile bounds."""
    scale = module.weight_scale.detach()
    if module.block is not None:
        raise TensorParallelError("FP8 weights with block scales (weight_block_size) are not split over ranks yet; "
                                  "per-tensor and per-channel scales are (--quantization fp8 gives per-channel)")
    return scale if idx is None or scale.numel() == 1 else scale[idx]


def _split_column(module: nn.Module, idx: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(module, FP8Linear):
            module.weight_scale = nn.Parameter(_fp8_scale(module, idx).contiguous(), requires_grad=False)
            module.weight = nn.Parameter(module.weight[idx].contiguous(), requires_grad=False)
            module.out_features = len(idx)
        elif _is_conv1d(module):
            module.weight = nn.Parameter(module.weight[:, idx].contiguous(), requires_grad=False)
            module.nf = len(idx)
        else:
            module.weight = nn.Parameter(module.weight[idx].contiguous(), requires_grad=False)
            module.out_features = len(idx)
        if getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(module.bias[idx].contiguous(), requires_grad=False)


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's input columns (``part``, bias-less), then the sum
    over the ranks, then the bias (once). Replaces an ``nn.Linear``, GPT-2 ``Conv1D`` or
    ``FP8Linear`` in its parent."""

    def __init__(self, module: nn.Module, idx: torch.Tensor, groups: Groups):
        super().__init__()
        with torch.no_grad():
            if isinstance(module, FP8Linear):  # this rank's input columns, every output row's scale
                self.part = FP8Linear(module.weight[:, idx].contiguous(), _fp8_scale(module, None), None,
                                      kernel=module.kernel)
            else:
                conv = _is_conv1d(module)
                weight = module.weight[idx] if conv else module.weight[:, idx]
                self.part = nn.Linear(len(idx), weight.shape[1] if conv else weight.shape[0], bias=False,
                                      device=weight.device, dtype=weight.dtype)
                self.part.weight = nn.Parameter((weight.t() if conv else weight).contiguous(),  # [out, in/N]
                                                requires_grad=False)
        bias = getattr(module, "bias", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in/N] -> [..., out]
        y = self.groups.all_reduce(self.part(x))
        return y if self.bias is None else y + self.bias


def shard_model(model: nn.Module, groups: Groups) -> ShardInfo:
    """Cut ``model`` (whole, on any device) to rank ``groups.rank``'s share, in place.

    Returns what the rank holds (the KV cache's heads); also set as ``model.tensor_parallel``.
    """
    info = check_tensor_parallel(model.config, groups.size)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    plan, shape = plan_for(text), _shape(text)
    info = ShardInfo(groups.rank, groups.size, info.q_heads, info.kv_heads)
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    layers = layers if layers is not None else decoder.h
    for k, layer in enumerate(layers):
        unplanned = [n for n, m in layer.named_modules() if _is_projection(m) and n not in plan.rules]
        if unplanned:
            raise TensorParallelError(f"{text.model_type}: layer {k} has projections no split rule covers: "
                                      f"{', '.join(unplanned)}")
        for path, rule in plan.rules.items():
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path) if parent_path else layer
            module = getattr(parent, name)
            if isinstance(rule, Column):
                _split_column(module, column_indices(rule, shape, groups.rank, groups.size))
            else:
                idx, _ = _part(rule.part, shape, groups.rank, groups.size)
                setattr(parent, name, RowParallel(module, idx, groups))
        _set_attention_attrs(layer.get_submodule(plan.attention), plan, info, shape)
    model.tensor_parallel = info
    return info


def _set_attention_attrs(attn: nn.Module, plan: Plan, info: ShardInfo, shape: _Shape) -> None:
    values = {"q": info.q_heads, "kv": info.kv_heads, "q_width": info.q_heads * shape.head_dim,
              "kv_width": info.kv_heads * shape.head_dim}
    for attr, what in plan.attrs.items():
        if what == "config":  # this module's own view: the model's config stays whole
            attn.config = _LocalHeads(attn.config, num_attention_heads=info.q_heads, num_key_value_heads=info.kv_heads)
        else:
            setattr(attn, attr, values[what])
    if hasattr(attn, "num_key_value_groups"):
        attn.num_key_value_groups = info.q_heads // info.kv_heads


class _LocalHeads:
    """A config as one rank's attention module sees it: this rank's head counts, everything
    else read live from the model's config (its attention implementation is set later)."""

    def __init__(self, config, **local):
        self._config = config
        self.__dict__.update(local)

    def __getattr__(self, name):
        return getattr(self._config, name)


class SkippedHead(nn.Module):
    """The LM head of ranks > 0: rank 0 computes the logits; the others return a [..., 1]
    placeholder (their hidden states are the same, so nothing is lost)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., :1]
