"""KV cache sizing (engine/memory.py) with made-up GPU figures, and through the config."""

import pytest

from specray.engine.memory import (
    ACTIVATION_RESERVE_BYTES, MAX_AUTO_SEQS, kv_bytes_per_token, plan_kv_cache,
)

GiB = 2**30


def test_bytes_per_token_counts_k_and_v_of_every_layer(tiny_pair):
    target = tiny_pair[0]
    # 2 layers x 2 kv heads x head_dim 8 x (K and V) x 4 bytes
    assert kv_bytes_per_token(target.config, "float32") == 2 * 2 * 2 * 8 * 4
    assert kv_bytes_per_token(target.config, "bfloat16") == 2 * 2 * 2 * 8 * 2


def test_sized_from_free_memory():
    per_token = 2**17  # 128 KiB per token (an 8B model in bf16)
    plan = plan_kv_cache(per_token, 8192, free_bytes=70 * GiB, total_bytes=80 * GiB, weights=16 * GiB,
                         utilization=0.9)
    budget = 70 * GiB - 8 * GiB - 16 * GiB - ACTIVATION_RESERVE_BYTES - int(0.05 * 16 * GiB)
    assert plan.max_model_len == 4096  # the default context cap
    assert plan.max_num_seqs == budget // (per_token * 4096)
    assert plan.kv_bytes <= budget and "sized from GPU memory" in plan.reason
    # a higher utilization gives more rows; given rows are used as given when they fit
    assert plan_kv_cache(per_token, 8192, free_bytes=70 * GiB, total_bytes=80 * GiB, weights=16 * GiB,
                         utilization=0.95).max_num_seqs > plan.max_num_seqs
    given = plan_kv_cache(per_token, 8192, max_num_seqs=4, max_model_len=2048, free_bytes=70 * GiB,
                          total_bytes=80 * GiB, weights=16 * GiB)
    assert (given.max_num_seqs, given.max_model_len, given.reason) == (4, 2048, "given")


def test_capped_and_cpu_default():
    plan = plan_kv_cache(64, 2048, free_bytes=80 * GiB, total_bytes=80 * GiB, weights=0, utilization=1.0)
    assert plan.max_num_seqs == MAX_AUTO_SEQS
    cpu = plan_kv_cache(64, 2048)
    assert (cpu.max_num_seqs, cpu.max_model_len) == (8, 2048) and "no GPU" in cpu.reason


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_num_seqs=None), "--max-model-len or raise --gpu-memory-utilization"),
    (dict(max_num_seqs=64), "--max-num-seqs 64 x --max-model-len 4096"),
    (dict(max_model_len=10**6), "--max-model-len 1000000: the model has only"),
    (dict(utilization=1.5), "--gpu-memory-utilization 1.5"),
])
def test_errors_name_the_flags(kwargs, words):
    with pytest.raises(ValueError) as info:
        plan_kv_cache(2**20, 8192, free_bytes=12 * GiB, total_bytes=16 * GiB, weights=8 * GiB, **kwargs)
    assert words in str(info.value)


def test_config_sizes_with_fake_free_memory(tiny_checkpoints):
    """On CPU nothing is sized; given (free, total) figures, the config derives its rows."""
    from specray.actors.config import SpecrayConfig

    cfg = SpecrayConfig(target=tiny_checkpoints["target"], draft=tiny_checkpoints["draft"])
    assert cfg.resolved().max_num_seqs == 8  # CPU default
    free_total = (ACTIVATION_RESERVE_BYTES + GiB, 2 * GiB)
    sized = cfg.resolved(free_total=free_total)
    per_token = (2 + 1) * 2 * 2 * 8 * 2  # target (2 layers) + draft (1), K and V, bfloat16 (auto on CUDA)
    plan = cfg.kv_plan(free_total=free_total)
    assert (sized.max_num_seqs, sized.max_model_len) == (plan.max_num_seqs, plan.max_model_len)
    assert plan.max_model_len == 256 and plan.bytes_per_token == per_token  # the tiny models' positions
    assert plan.max_num_seqs == MAX_AUTO_SEQS and plan.reason.startswith("sized from GPU")


def test_a_split_target_sizes_rank_zeros_share(tiny_pair):
    """At TP N a rank holds 1/N of the KV heads (at least one: replicated) and about 1/N of the
    split weights; the embedding and LM head stay whole."""
    from specray.engine.memory import rank_weight_bytes

    config = tiny_pair[0].config  # 2 KV heads, untied
    assert kv_bytes_per_token(config, "float32", 2) == kv_bytes_per_token(config, "float32") // 2
    assert kv_bytes_per_token(config, "float32", 4) == kv_bytes_per_token(config, "float32") // 2  # replicated
    whole = 2 * 64 * 32 * 4  # embedding + LM head, float32
    weights = whole + 8000
    assert rank_weight_bytes(weights, config, "float32", 1) == weights
    assert rank_weight_bytes(weights, config, "float32", 2) == whole + 4000
