"""Tensor parallelism in one process: the split (engine/tensor_parallel.py) and the mirrored
control plane (engine/mirror.py), with each rank a thread over gloo (no Ray).

* The split of every served architecture computes the whole model's logits.
* What cannot be split is refused with the reason.
* Rank 0's engine at TP 2 (the draft whole, or split too) gives the same greedy tokens as the
  engine at TP 1 for every method, at batch 1 and 4 with ragged prompts, eager and static;
  on every architecture's tiny checkpoint for the methods its weights allow.
* Sampling at TP 2 keeps the target's distribution (tests/test_sampling_e2e.py's chi-square).
* The control plane sends one message per model forward, not one per runner call.

tests/test_tensor_parallel_ray.py runs the same over Ray actors, one process per rank.
"""

from __future__ import annotations

import contextlib
import copy
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from specray.engine.collectives import local_groups
from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.mirror import Follower, ShardedRunners
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.tensor_parallel import TensorParallelError, check_tensor_parallel, shard_model
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import tiny_llama
from tests.test_eagle import random_head
from tests.test_eagle3 import random_head3
from tests.test_engine import GREEDY, ragged_prompts
from tests.test_medusa import random_heads
from tests.test_redrafter import random_drafter
from tests.test_static_step import SPECS as STATIC_SPECS

SPECS = {**STATIC_SPECS, "eagle3": {}, "suffix": {}}  # every method, EAGLE-2 dynamic trees included
SHORT = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@contextlib.contextmanager
def thread_group(size: int = 2, draft_sharded: bool = False, **config):
    """Ranks 1.. as threads serving rank 0's calls; yields rank 0's runner factory."""
    store = dist.HashStore()
    followers: list[Follower] = []
    errors: list[BaseException] = []

    def follow(rank: int) -> None:
        try:
            f = Follower(local_groups(store, rank, size))
            followers.append(f)
            f.serve()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=follow, args=(r,), daemon=True) for r in range(1, size)]
    for t in threads:
        t.start()
    config = EngineConfig(target="x", device="cpu", dtype="float32", tensor_parallel_size=size,
                          draft_tensor_parallel_size=size if draft_sharded else 1, **config)
    runners = ShardedRunners(local_groups(store, 0, size), config)
    runners.followers = followers
    try:
        yield runners
    finally:
        runners.stop()
        for t in threads:
            t.join(timeout=30)
    assert not errors, errors


def engine(target, draft=None, tp: int = 1, runners=None, **kw) -> LLMEngine:
    """Every method's weights (random heads) around copies of the tiny pair."""
    kw.setdefault("speculation_length", SpeculationLengthPolicy())  # every row drafts, whatever the timings
    return LLMEngine(
        EngineConfig(target="x", tensor_parallel_size=tp, **kw),
        target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft) if draft is not None else None,
        medusa_heads=random_heads(),
        resources={"eagle": random_head(target), "eagle3": random_head3(target), "redrafter": random_drafter()},
        runners=runners,
    )


def speculation(name: str) -> SpeculationParams:
    return SpeculationParams(method=name.split("-")[0], **SPECS[name])


def tokens(e: LLMEngine, prompts, name: str, sampling=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in e.generate(prompts, sampling, speculation(name))]


# -- the split -----------------------------------------------------------------------------------
def sharded_logits(model, ids, size: int = 2) -> list[torch.Tensor]:
    """Each rank's logits of ``model`` split over ``size`` thread ranks (HF's own forward)."""
    store, out = dist.HashStore(), {}

    def run(rank):
        m = copy.deepcopy(model)
        shard_model(m, local_groups(store, rank, size))
        with torch.no_grad():
            out[rank] = m(ids).logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [out[r] for r in range(size)]


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi",
                                  "phi3", "starcoder2", "gpt2", "gpt_bigcode", "gpt_neox", "opt"])
def test_the_split_of_every_architecture_computes_the_whole_model(name):
    from tests.test_architectures import ARCHS

    model = ARCHS[name].build(layers=2, seed=0)
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids).logits
    for logits in sharded_logits(model, ids):
        torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)


def test_kv_heads_divide_or_replicate():
    model = tiny_llama(kv_heads=2)
    assert check_tensor_parallel(model.config, 2).kv_heads == 1
    assert check_tensor_parallel(model.config, 4).kv_heads == 1  # 2 KV heads, each on two of four ranks
    assert check_tensor_parallel(tiny_llama(kv_heads=4).config, 2).kv_heads == 2


@pytest.mark.parametrize("change, size, reason", [
    ({}, 3, "4 attention heads do not divide over 3 ranks"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 36}, 2,
     "3 KV heads neither divide over 2 ranks"),
    ({"intermediate_size": 65}, 2, "an MLP width of 65 does not divide over 2 ranks"),
    ({"model_type": "falcon"}, 2, "architecture 'falcon' has no tensor-parallel plan"),
])
def test_what_cannot_be_split_is_refused_with_the_reason(change, size, reason):
    config = copy.deepcopy(tiny_llama().config)
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(TensorParallelError, match=reason):
        check_tensor_parallel(config, size)


def test_a_projection_without_a_rule_is_refused():
    model = tiny_llama()
    model.model.layers[1].mlp.extra_proj = nn.Linear(32, 32)  # e.g. a layer type the plan does not know
    store = dist.HashStore()
    with pytest.raises(TensorParallelError, match="layer 1 has projections no split rule covers: mlp.extra_proj"):
        shard_model(model, local_groups(store, 0, 1))


# -- the engine at TP 2 ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp1_references(tiny_pair):
    """TP-1 greedy tokens of every method for ragged_prompts(4) (they equal HF generate: test_static_step)."""
    e = engine(*tiny_pair, max_num_seqs=4)
    return {name: tokens(e, ragged_prompts(4), name, SHORT) for name in SPECS}


@pytest.mark.parametrize("step", ["eager", "static"])
@pytest.mark.parametrize("draft_tp", [1, 2])
def test_every_method_at_tp2_equals_tp1(tiny_pair, tp1_references, step, draft_tp):
    """Batch 4 (ragged prompts, one engine, every method in turn), then batch 1."""
    prompts = ragged_prompts(4)
    with thread_group(2, draft_sharded=draft_tp == 2) as runners:
        e = engine(*tiny_pair, tp=2, runners=runners, max_num_seqs=4, step=step, draft_tensor_parallel_size=draft_tp)
        for name in SPECS:
            assert tokens(e, prompts, name, SHORT) == tp1_references[name], name
        for name in SPECS:
            assert tokens(e, prompts[3:], name, SHORT) == tp1_references[name][3:], name
        assert runners.followers[0].runners.keys() == ({"target", "draft"} if draft_tp == 2 else {"target"})


def test_one_control_message_per_forward(tiny_pair):
    """Lengths, compaction and resets ride along with the next forward: a decode step costs one
    message, whatever the batch."""
    with thread_group(2) as runners:
        e = engine(*tiny_pair, tp=2, runners=runners, max_num_seqs=4)
        forwards = []
        real = e.target.forward  # the mirrored one: count what rank 0 asks of the model
        e.target.forward = lambda *a, **k: forwards.append(1) or real(*a, **k)
        stats = runners.mirror.stats
        before = stats.messages
        e.generate(ragged_prompts(4), SHORT, speculation("ngram"))
        assert stats.messages - before == len(forwards) > 0
        assert runners.followers[0].stats.messages == stats.messages


def test_a_draft_split_with_the_target_is_refused_in_process(tiny_pair):
    with pytest.raises(ValueError, match="needs a group of ranks"):
        LLMEngine(EngineConfig(target="x", tensor_parallel_size=2), target_model=copy.deepcopy(tiny_pair[0]))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1 or tensor_parallel_size"):
        EngineConfig(target="x", tensor_parallel_size=2, draft_tensor_parallel_size=3)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi",
                                  "phi3", "starcoder2", "gpt2", "gpt_bigcode", "gpt_neox", "opt"])
def test_every_architecture_at_tp2_equals_hf_generate(name):
    """tests/test_architectures.py's matrix at TP 2: greedy none / draft / ngram / medusa at batch 4
    with ragged prompts equal HF generate (the target's KV heads split or replicated)."""
    from tests.test_architectures import GREEDY as ARCH_GREEDY, PROMPTS, family

    target, draft, heads, refs = family(name)
    with thread_group(2) as runners:
        # Static speculation lengths: every row drafts, whatever this machine's timings.
        e = LLMEngine(EngineConfig(target="x", max_num_seqs=4, tensor_parallel_size=2,
                                   speculation_length=SpeculationLengthPolicy()),
                      target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft), medusa_heads=heads,
                      runners=runners)
        for method in ("none", "draft", "ngram", "medusa"):
            spec = SpeculationParams(method=method) if method in ("none", "medusa") else \
                SpeculationParams(method=method, num_speculative_tokens=3)
            drafts = e.totals.num_drafts
            assert [o.token_ids for o in e.generate(PROMPTS[:4], ARCH_GREEDY, spec)] == refs[:4], method
            assert (e.totals.num_drafts > drafts) == (method != "none"), method


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampling_at_tp2_keeps_the_target_distribution(method):
    from tests.test_sampling_e2e import N, PARAMS, PROMPT, VOCAB, check, exact_joint

    target, draft = tiny_llama(vocab=VOCAB, seed=3, init=0.25), tiny_llama(vocab=VOCAB, layers=1, seed=4, init=0.25)
    with thread_group(2) as runners:
        # No start-up profile: every row sets its k, which the budget keeps (the cost table
        # changes no sample). Each row's seed fixes its sample whatever the batch: large
        # batches, few steps.
        e = LLMEngine(EngineConfig(target="x", max_num_seqs=1024, tensor_parallel_size=2, profile_costs=False),
                      target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft), runners=runners)
        params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
        outs = e.generate([PROMPT] * N, params, SpeculationParams(method=method, num_speculative_tokens=3))
        t = e.totals
        assert t.num_drafts > N // 2 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    pvals = check(np.array([o.token_ids for o in outs]), exact_joint(target))
    assert min(pvals) > 1e-3, pvals


@pytest.mark.slow
@pytest.mark.parametrize("step", ["eager", "static"])
def test_the_demo_pair_at_tp2_equals_tp1(demo_models, step):
    """The trained demo pair (12 layers, 2 KV heads: one per rank), every method its weights
    allow with a random EAGLE head on its features, at batch 4 (ragged held-out prompts) and 1."""
    from specray.demo import held_out_prompts
    from specray.demo import load_or_build_demo_pair

    target, draft, tok = demo_models
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(4, load_or_build_demo_pair().tokenizer,
                                                                 min_tokens=16, max_tokens=96)]
    names = ["none", "draft", "ngram", "eagle", "eagle-2", "lookahead", "suffix"]

    def make(tp, runners=None):
        return LLMEngine(EngineConfig(target="x", max_num_seqs=4, step=step, tensor_parallel_size=tp,
                                      speculation_length=SpeculationLengthPolicy()),
                         target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft), tokenizer=tok,
                         resources={"eagle": random_head(target)}, runners=runners)

    whole = make(1)
    refs = {n: tokens(whole, prompts, n, GREEDY) for n in names}
    with thread_group(2) as runners:
        e = make(2, runners)
        for n in names:
            assert tokens(e, prompts, n, GREEDY) == refs[n], n
            assert tokens(e, prompts[1:2], n, GREEDY) == refs[n][1:2], n


def test_the_documented_layout_is_what_the_split_gives(capsys):
    """docs/tensor-parallel.md's 70B + 1B table is this command's output (meta-device models,
    split as specray splits them)."""
    import pathlib

    from specray.bench import tensor_parallel as bench

    assert bench.main(["--layout", "llama-3-70b:4,llama-3.2-1b:1"]) == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("role", "target", "draft"))]
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "tensor-parallel.md").read_text()
    assert len(printed) == 6 and all(line in doc for line in printed)


def test_fp8_weights_split_too(tiny_pair):
    """An FP8 target (per-channel scales, as --quantization fp8 makes) at TP 2 decodes as the same
    FP8 target at TP 1: the FP8 rows and scales split with the weights."""
    from specray.engine.quantization import FP8Linear, quantize_linears

    target = copy.deepcopy(tiny_pair[0])
    quantize_linears(target)
    prompts = ragged_prompts(4)
    whole = engine(target, tiny_pair[1], max_num_seqs=4)
    with thread_group(2) as runners:
        e = engine(target, tiny_pair[1], tp=2, runners=runners, max_num_seqs=4)
        assert isinstance(e.target.decoder.layers[0].self_attn.q_proj, FP8Linear)
        for name in ("none", "draft", "ngram"):
            assert tokens(e, prompts, name, SHORT) == tokens(whole, prompts, name, SHORT), name


@pytest.mark.parametrize("name", ["draft", "eagle", "medusa"])
def test_paged_kv_at_tp2_preempts_and_reuses_blocks_as_tp1(tiny_pair, name):
    """A small pool at TP 2: requests are preempted and recomputed, shared prefixes come from the
    prefix cache, and every rank's block tables are rank 0's (the mirrored reserve/attach/publish
    calls), so the tokens equal the unpaged engine's at TP 1."""
    from tests.test_paged_kv import shared_prompts

    prompts = shared_prompts(8)
    sampling = SamplingParams(max_tokens=40, temperature=0.0)
    reference = tokens(engine(*tiny_pair, paged_kv=False), prompts, name, sampling)
    with thread_group(2) as runners:
        e = engine(*tiny_pair, tp=2, runners=runners, num_kv_blocks=12)
        assert tokens(e, prompts, name, sampling) == reference
        stats = e.stats()
        assert stats["preemptions"] > 0 and stats["kv"]["prefix_hits"] > 0, stats["kv"]
