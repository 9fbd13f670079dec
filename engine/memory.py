"""How many tokens the KV cache holds: sized from GPU memory.

Paged (the default, ``engine/kv_blocks.py``): each model's pool of blocks is sized here, and
``max_num_seqs`` only caps the running batch. Contiguous (``paged_kv`` off): every slot's
whole context is preallocated (``ModelRunner``: ``max_num_seqs`` rows x ``max_model_len``
positions, per layer, K and V, for the target and for a draft model), so the two numbers
decide the cache's size. Given on the command line they are used as given;
left out on CUDA they are derived, as vLLM derives its cache, from the fraction of the GPU
this server may use (``gpu_memory_utilization``):

    budget    = free now - total x (1 - utilization) - weights - activation reserve
    sequences = budget // (bytes per token x max_model_len)      (at most MAX_AUTO_SEQS)

"free now" already excludes what other processes hold. On CPU nothing is sized: the
defaults (8 sequences, the model's context up to ``DEFAULT_CONTEXT_CAP``) hold. Pure arithmetic over model
configs and memory figures, so it is tested on CPU with made-up figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from specray.engine.config import DEFAULT_CONTEXT_CAP

DEFAULT_MAX_NUM_SEQS = 8  # without a GPU to size from
MAX_AUTO_SEQS = 256  # vLLM's default max_num_seqs: more rows than this rarely pay per step
# Activations of one forward (logits over the vocabulary for every verified token, attention
# scores, MLP intermediates) are not in the cache: keep this much aside, plus a share of the
# weights' size for the larger models' wider intermediates.
ACTIVATION_RESERVE_BYTES = 512 * 2**20
ACTIVATION_RESERVE_OF_WEIGHTS = 0.05
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def kv_bytes_per_token(config, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Bytes one token's keys and values take in every layer of a model (a HF config), on one
    rank of ``tensor_parallel_size`` (its share of the KV heads, at least one: replicated)."""
    text = _text_config(config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    kv_heads = max(1, kv_heads // tensor_parallel_size)
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype_bytes(dtype)


def rank_weight_bytes(weights: int, config, dtype: str, tensor_parallel_size: int = 1) -> int:
    """Rank 0's share of a model's weights split over ``tensor_parallel_size`` ranks: the split
    layers' 1/N, plus the embedding and LM head every rank (the head: rank 0) holds whole."""
    if tensor_parallel_size == 1:
        return weights
    text = _text_config(config)
    whole = (1 if getattr(text, "tie_word_embeddings", False) else 2) * text.vocab_size * text.hidden_size
    whole = min(weights, whole * dtype_bytes(dtype))
    return (weights - whole) // tensor_parallel_size + whole


def weight_bytes(path: str, config, dtype: str) -> int:
    """The checkpoint's weights as they will sit in memory (file sizes, rescaled from the
    dtype they are stored in to the one they load in)."""
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(_WEIGHT_FILES)]
    stored = sum(os.path.getsize(f) for f in files)
    stored_dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    stored_dtype = stored_dtype.replace("torch.", "")
    try:
        ratio = dtype_bytes(dtype) / dtype_bytes(stored_dtype)
    except (AttributeError, TypeError):
        ratio = 1.0
    return int(stored * ratio)


@dataclass(frozen=True)
class KVPlan:
    """What the cache holds and why: ``reason`` says whether the numbers were given or derived.

    Contiguous (``num_blocks`` None): ``max_num_seqs`` rows of ``max_model_len`` tokens.
    Paged: a pool of ``num_blocks`` blocks of ``block_size`` tokens per model, and at most
    ``max_num_seqs`` sequences running at once (a cap, not the memory plan)."""

    max_num_seqs: int
    max_model_len: int
    bytes_per_token: int
    reason: str
    num_blocks: int | None = None
    block_size: int = 16

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size if self.num_blocks is not None else self.max_num_seqs * self.max_model_len

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.bytes_per_token

    def describe(self) -> str:
        if self.num_blocks is not None:
            return (f"paged, {self.num_blocks} blocks x {self.block_size} tokens ({self.kv_tokens} tokens, "
                    f"{self.kv_bytes / 2**20:.1f} MiB; {self.reason}), at most {self.max_num_seqs} sequences of "
                    f"{self.max_model_len} tokens at once")
        return (f"{self.max_num_seqs} sequences x {self.max_model_len} tokens, "
                f"{self.kv_bytes / 2**20:.1f} MiB ({self.reason})")


def plan_kv_cache(
    bytes_per_token: int,
    model_len_limit: int,
    *,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    free_bytes: int | None = None,
    total_bytes: int | None = None,
    weights: int = 0,
    utilization: float = 0.9,
    block_size: int | None = None,
    num_blocks: int | None = None,
    kv_bytes: int | None = None,
) -> KVPlan:
    """The cache's size.

    bytes_per_token: K/V bytes per token of every model that keeps a cache (target + draft);
    model_len_limit: the target's positions; free/total_bytes: the GPU's (None: not sized,
    e.g. on CPU); weights: bytes the models' weights will take. block_size: paged (the
    default layout): the pool, in blocks, is ``num_blocks`` if given, else ``kv_bytes``' worth,
    else what the GPU leaves, else ``max_num_seqs`` contexts (CPU); ``max_num_seqs`` then only
    caps the running batch (on a GPU, default ``MAX_AUTO_SEQS``). None: contiguous rows.
    Raises ValueError, naming the flags to change, when not even one sequence (contiguous) or
    one block (paged) fits.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization {utilization}: must lie in (0, 1]")
    if max_model_len is not None and max_model_len > model_len_limit:
        raise ValueError(f"--max-model-len {max_model_len}: the model has only {model_len_limit} positions")
    context = max_model_len or min(model_len_limit, DEFAULT_CONTEXT_CAP)
    gpu = free_bytes is not None and total_bytes is not None
    budget = gib = None
    if gpu:
        reserve = ACTIVATION_RESERVE_BYTES + int(ACTIVATION_RESERVE_OF_WEIGHTS * weights)
        budget = free_bytes - int(total_bytes * (1 - utilization)) - weights - reserve
        gib = max(budget, 0) / 2**30
    if block_size is not None:
        return _paged_plan(bytes_per_token, context, block_size, max_num_seqs, num_blocks, kv_bytes, budget, gib,
                           utilization)
    if not gpu:
        seqs = max_num_seqs or DEFAULT_MAX_NUM_SEQS
        return KVPlan(seqs, context, bytes_per_token, "given" if max_num_seqs else "default, no GPU to size from")
    fits = max(budget, 0) // (bytes_per_token * context)
    if max_num_seqs is not None:
        if fits < max_num_seqs:
            raise ValueError(
                f"--max-num-seqs {max_num_seqs} x --max-model-len {context} needs "
                f"{max_num_seqs * context * bytes_per_token / 2**30:.2f} GiB of KV cache; {gib:.2f} GiB is left "
                f"at --gpu-memory-utilization {utilization} after the weights: lower them or raise the utilization")
        return KVPlan(max_num_seqs, context, bytes_per_token, "given")
    if fits < 1:
        raise ValueError(
            f"one sequence of --max-model-len {context} needs {context * bytes_per_token / 2**30:.2f} GiB of KV "
            f"cache; {gib:.2f} GiB is left at --gpu-memory-utilization {utilization} after the weights: "
            "lower --max-model-len or raise --gpu-memory-utilization")
    seqs = int(min(fits, MAX_AUTO_SEQS))
    return KVPlan(seqs, context, bytes_per_token,
                  f"sized from GPU memory: {gib:.2f} GiB for the cache at --gpu-memory-utilization {utilization}")


def _paged_plan(per_token, context, block_size, max_num_seqs, num_blocks, kv_bytes, budget, gib, utilization):
    block_bytes = per_token * block_size
    seqs = max_num_seqs or (MAX_AUTO_SEQS if budget is not None else DEFAULT_MAX_NUM_SEQS)
    if num_blocks is not None:
        reason = "given (--num-gpu-blocks-override)"
    elif kv_bytes is not None:
        num_blocks, reason = kv_bytes // block_bytes, f"--kv-cache-memory-bytes {kv_bytes}"
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory-bytes {kv_bytes} holds no block of {block_size} tokens "
                             f"({block_bytes} bytes): raise it or lower --block-size")
    elif budget is not None:
        num_blocks = max(budget, 0) // block_bytes
        reason = f"sized from GPU memory: {gib:.2f} GiB at --gpu-memory-utilization {utilization}"
        if num_blocks < 1:
            raise ValueError(f"no KV block of {block_size} tokens fits: {gib:.2f} GiB is left at "
                             f"--gpu-memory-utilization {utilization} after the weights: raise it")
    else:
        num_blocks = seqs * -(-context // block_size)
        reason = f"{seqs} contexts' worth, no GPU to size from (--kv-cache-memory-bytes sets it)"
    return KVPlan(seqs, context, per_token, reason, int(num_blocks), block_size)


def plan_for_checkpoints(
    paths: Sequence[str],
    dtype: str,
    *,
    max_model_len: int | None,
    max_num_seqs: int | None,
    utilization: float,
    device: str,
    free_total: tuple[int, int] | None = None,
    block_size: int | None = None,
    num_blocks: int | None = None,
    kv_bytes: int | None = None,
    quantization: Sequence[str | None] = (),
    tensor_parallel: Sequence[int] | None = None,
) -> KVPlan:
    """``plan_kv_cache`` for checkpoint dirs (the target first, then a draft), reading only
    their configs and file sizes. ``free_total`` overrides the GPU's (free, total) bytes
    (tests); on a CUDA ``device`` it is read from the driver, on CPU nothing is sized.
    ``quantization``: each path's ``--quantization`` (FP8 weights take their FP8 size).
    ``tensor_parallel``: the ranks each checkpoint is split over (default 1 each); the plan is
    rank 0's device, which holds the most (its shards, the whole LM head, a whole draft)."""
    from specray.engine.quantization import planned_weight_bytes

    from transformers import AutoConfig

    configs = [AutoConfig.from_pretrained(p) for p in paths]
    splits = list(tensor_parallel or [1] * len(paths))
    limit = getattr(_text_config(configs[0]), "max_position_embeddings", None) or DEFAULT_CONTEXT_CAP
    per_token = sum(kv_bytes_per_token(c, dtype, n) for c, n in zip(configs, splits))
    if free_total is None and device.startswith("cuda"):
        free_total = torch.cuda.mem_get_info(torch.device(device))
    quantization = list(quantization) + [None] * (len(paths) - len(quantization))
    weights = 0
    if free_total:
        for p, c, q, n in zip(paths, configs, quantization, splits):
            fp8 = planned_weight_bytes(p, dtype, q)
            weights += rank_weight_bytes(weight_bytes(p, c, dtype) if fp8 is None else fp8, c, dtype, n)
    free, total = free_total if free_total else (None, None)
    return plan_kv_cache(per_token, limit, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                         free_bytes=free, total_bytes=total, weights=weights, utilization=utilization,
                         block_size=block_size, num_blocks=num_blocks, kv_bytes=kv_bytes)
