"""Paged KV (``engine/kv_blocks.py``, ``kernels/attention.PagedCache``): blocks, prefix caching,
admission by free blocks and preemption, against the contiguous cache and HF ``generate``.

* The pool: allocation, reference counts, cached prefixes reused and evicted least recently
  used first, a full pool raising ``KVCacheFull``.
* The runner: paged forwards (eager and fixed-shape) and tree compaction equal the
  contiguous cache's; a row attached to cached blocks continues exactly.
* The engine, every method, batch 1 and 8, ragged prompts sharing prefixes: greedy output
  identical with paging on and off and with prefix caching on and off, including requests
  preempted and recomputed in a pool too small for the batch; the hit rate of repeated
  prompts with an EAGLE head; a prompt that can never fit is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from specray.engine.config import EngineConfig
from specray.engine.intake import ContextLengthError
from specray.engine.kv_blocks import BlockPool, BlockTables, KVCacheFull, PagingConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams
from specray.engine.runner import ModelRunner
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import tiny_llama
from tests.test_eagle import random_head
from tests.test_eagle3 import random_head3
from tests.test_medusa import random_heads
from tests.test_redrafter import random_drafter
from tests.test_static_step import SPECS, speculation

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def full_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


# -- the pool ------------------------------------------------------------------------------
def test_pool_reference_counts_cache_and_evict_least_recently_freed():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.publish(a, b"A")
    pool.publish(b, b"B")
    pool.take(a)  # a second row starts with prefix A
    pool.release(a)
    assert pool.refs[a] == 1 and pool.num_free == 2
    pool.release(b)
    pool.release(a)  # both free now, still cached: b freed first
    assert pool.num_free == 4 and pool.lookup([b"A"]) == [a] and pool.lookup([b"B", b"A"]) == [b, a]
    taken = [pool.allocate() for _ in range(3)]  # two never-cached blocks, then b (the older)
    assert b in taken and a not in taken and pool.lookup([b"B"]) == [] and pool.lookup([b"A"]) == [a]
    pool.allocate()
    with pytest.raises(KVCacheFull):
        pool.allocate()


def test_prefix_keys_chain_and_shift():
    table = torch.full((3, 5), 8, dtype=torch.long)
    plain, shifted = BlockTables(BlockPool(8), table, 4), BlockTables(BlockPool(8), table.clone(), 4, shift=1)
    ids = list(range(10))
    assert len(plain.keys(ids, 9)) == 2 and len(shifted.keys(ids, 9)) == 2  # (10 - 1) // 4
    assert len(shifted.keys(ids[:8], 8)) == 1  # block 1 needs token 8 too
    # a block's key depends on everything before it; a shifted one on the next token too
    assert plain.keys([9] + ids[1:], 9)[1] != plain.keys(ids, 9)[1]
    assert plain.keys(ids[:8] + [99, 98], 9) == plain.keys(ids, 9)
    assert shifted.keys(ids[:8] + [99, 98], 9)[1] != shifted.keys(ids, 9)[1]


# -- the runner ----------------------------------------------------------------------------
@pytest.mark.parametrize("step", ["eager", "static"])
def test_paged_runner_equals_contiguous_with_trees(step):
    ref = tiny_llama(kv_heads=2)
    runners = [ModelRunner(copy.deepcopy(ref), 4, 64), ModelRunner(copy.deepcopy(ref), 4, 64, PagingConfig(4, 40))]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    outs = []
    for runner in runners:
        if step == "static":
            runner.enable_static("static")
        runner.forward([3, 1], [[1, 2, 3, 4, 5, 6, 7], [9, 10, 11]])
        layout = (tree[None].repeat(2, 1, 1), torch.tensor([[0, 1, 1, 2]] * 2))
        run = runner.static.run if step == "static" else runner.forward
        got = [run([3, 1], [[20, 21, 22, 23], [24, 25, 26, 27]], layout=layout).logits]
        runner.keep([(3, 7, [0, 2, 3]), (1, 3, [0, 1])])  # compaction inside the rows' blocks
        got.append(runner.forward([3, 1], [[30], [31]]).logits)
        outs.append(got)
    for paged, contiguous in zip(outs[1], outs[0]):
        torch.testing.assert_close(paged, contiguous, atol=1e-5, rtol=0)
    torch.testing.assert_close(outs[1][1][0, 0], full_logits(ref, [1, 2, 3, 4, 5, 6, 7, 20, 22, 23, 30])[-1],
                               atol=1e-5, rtol=0)


def test_attached_prefix_continues_exactly_and_frees_to_the_cache():
    ref = tiny_llama(kv_heads=2)
    runner = ModelRunner(copy.deepcopy(ref), 4, 64, PagingConfig(4, 12))
    first = list(range(1, 12))
    runner.forward([0], [first])
    runner.publish(0, first)
    second = first[:9] + [30, 31]
    cached = runner.cached_prefix(second, len(second) - 1)
    assert cached == 8  # two full blocks in common (the third differs at token 9)
    start = runner.attach(1, second, cached)
    out = runner.forward([1], [second[start:]], logits_at=torch.arange(len(second) - start)[None])
    torch.testing.assert_close(out.logits[0], full_logits(ref, second)[start:], atol=1e-5, rtol=0)
    assert runner.blocks.rows[1][:2] == runner.blocks.rows[0][:2]  # shared, not copied
    runner.reset(0)
    runner.reset(1)
    assert runner.blocks.pool.num_free == 12 and runner.cached_prefix(first, 10) == 8


def test_a_full_pool_raises_and_keeps_the_row():
    runner = ModelRunner(tiny_llama(), 2, 32, PagingConfig(4, 3))
    runner.forward([0], [list(range(8))])
    with pytest.raises(KVCacheFull):
        runner.forward([1], [list(range(8))])
    assert runner.lengths[1] == 0 and runner.blocks.held(0) == 2


# -- the engine ----------------------------------------------------------------------------
def engine(models, step="eager", max_num_seqs=8, **kw) -> LLMEngine:
    target, draft = models
    kw.setdefault("speculation_length", SpeculationLengthPolicy())
    return LLMEngine(
        EngineConfig(target="x", max_num_seqs=max_num_seqs, step=step, max_model_len=128, **kw),
        target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft), medusa_heads=random_heads(),
        resources={"eagle": random_head(target), "eagle3": random_head3(target), "redrafter": random_drafter()},
    )


ALL = {**SPECS, "eagle3": {}, "suffix": {}}  # every method (the static-step table lacks these two)


def spec_of(name: str):
    from specray.engine.params import SpeculationParams

    return speculation(name) if name in SPECS else SpeculationParams(method=name, **ALL[name])


def shared_prompts(n: int) -> list[list[int]]:
    """Ragged prompts, most sharing a 37-token system prompt (two full blocks of 16 and a bit)."""
    system = [(7 * i + 3) % 64 for i in range(37)]
    return [system + [(11 * i + j) % 64 for j in range(1 + 3 * i)] if i % 3 else [(5 * i + j) % 64 for j in range(9 + i)]
            for i in range(n)]


def run(e: LLMEngine, prompts, name: str, waves: int = 2) -> list[list[int]]:
    """Prompts in waves (later ones find the earlier ones' blocks cached)."""
    out = []
    size = -(-len(prompts) // waves)
    for w in range(waves):
        out += [o.token_ids for o in e.generate(prompts[w * size:(w + 1) * size], GREEDY, spec_of(name))]
    return out


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_identical_paged_or_not_cached_or_not(tiny_pair, name, batch):
    prompts = shared_prompts(8 if batch == 8 else 3)
    waves = 2 if batch == 8 else 3
    reference = run(engine(tiny_pair, paged_kv=False, max_num_seqs=batch), prompts, name, waves)
    paged = engine(tiny_pair, max_num_seqs=batch)
    assert run(paged, prompts, name, waves) == reference
    assert paged.stats()["kv"]["prefix_hits"] > 0  # later waves reused the system prompt's blocks
    assert run(engine(tiny_pair, max_num_seqs=batch, enable_prefix_caching=False), prompts, name, waves) == reference


@pytest.mark.parametrize("name", list(ALL))
def test_preempted_requests_resume_exactly(tiny_pair, name):
    """A pool of 12 blocks of 16 tokens for 8 requests of up to 84 tokens each: requests are
    preempted and recomputed, and every output equals the unpaged engine's."""
    prompts = shared_prompts(8)
    sampling = SamplingParams(max_tokens=40, temperature=0.0)
    reference = [o.token_ids for o in engine(tiny_pair, paged_kv=False).generate(prompts, sampling, spec_of(name))]
    small = engine(tiny_pair, num_kv_blocks=12)
    assert [o.token_ids for o in small.generate(prompts, sampling, spec_of(name))] == reference
    assert small.stats()["preemptions"] > 0


@pytest.mark.parametrize("name", ["draft", "eagle", "medusa"])
def test_static_step_paged_with_preemption(tiny_pair, name):
    prompts = shared_prompts(8)
    sampling = SamplingParams(max_tokens=40, temperature=0.0)
    reference = [o.token_ids for o in engine(tiny_pair, paged_kv=False).generate(prompts, sampling, speculation(name))]
    small = engine(tiny_pair, "static", num_kv_blocks=12)
    assert [o.token_ids for o in small.generate(prompts, sampling, speculation(name))] == reference
    assert small.stats()["preemptions"] > 0


def test_repeated_prompts_hit_the_cache_with_an_eagle_head(tiny_pair):
    """The head's blocks are keyed with the token after them, so none is dropped at a block
    boundary: repeated prompts reuse every full block the target has."""
    e = engine(tiny_pair)
    prompt = [(3 * j + 1) % 64 for j in range(81)]  # 5 full blocks + 1 token
    e.generate([prompt], GREEDY, speculation("eagle"))
    before = e.stats()["kv"]
    for _ in range(4):
        e.generate([prompt], GREEDY, speculation("eagle"))
    after = e.stats()["kv"]
    hits = (after["prefix_hits"] - before["prefix_hits"]) / (after["prefix_queries"] - before["prefix_queries"])
    assert hits >= 80 / 81 - 1e-9  # all but the last token, which is always computed


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_a_head_that_never_drafted_still_caches_its_prompt(tiny_pair, name):
    """Drafting kept off throughout (as the self-tuning length may): the head still runs over
    the prompt, so a repeat of it finds every full block cached in the target and the head."""
    e = engine(tiny_pair, speculation_length=SpeculationLengthPolicy(batch_k_caps=((1, 0),)))
    prompt = [(3 * j + 1) % 64 for j in range(81)]
    first = e.generate([prompt], GREEDY, speculation(name))[0]
    assert first.metrics["target_forward_passes"] == GREEDY.max_tokens  # one token a step: nothing drafted
    before = e.stats()["kv"]
    e.generate([prompt], GREEDY, speculation(name))
    after = e.stats()["kv"]
    assert after["prefix_hits"] - before["prefix_hits"] == 80  # all but the last token


@pytest.mark.parametrize("name", ["draft", "eagle"])
def test_reset_prefix_cache_drops_the_targets_and_the_drafters_cached_blocks(tiny_pair, name):
    """``reset_prefix_cache`` (vLLM's ``LLM.reset_prefix_cache``): a repeated prompt then hits
    nothing, in the target or the drafter, and decodes as before; refused while a request is in
    the engine (its rows' blocks would be published no more)."""
    e = engine(tiny_pair)
    prompt = [(3 * j + 1) % 64 for j in range(81)]
    first = e.generate([prompt], GREEDY, spec_of(name))[0]
    proposer = e.proposers.get(name)
    pools = [e.target.blocks.pool, proposer.runner.blocks.pool]
    assert all(pool.num_cached for pool in pools)
    e.add_request(prompt, GREEDY, spec_of(name))
    assert e.reset_prefix_cache() is False and all(pool.num_cached for pool in pools)
    while e.has_unfinished():
        e.step()
    assert e.reset_prefix_cache() is True and not any(pool.num_cached for pool in pools)
    before = e.stats()["kv"]["prefix_hits"]
    again = e.generate([prompt], GREEDY, spec_of(name))[0]
    assert e.stats()["kv"]["prefix_hits"] == before and again.token_ids == first.token_ids


def test_a_prompt_that_can_never_fit_is_refused_and_a_long_one_stops_at_the_pool(tiny_pair):
    e = engine(tiny_pair, num_kv_blocks=3, max_num_seqs=2)  # 48 tokens in all
    with pytest.raises(ContextLengthError, match="48"):
        e.add_request(list(range(60)), GREEDY)
    out = e.generate([list(range(40))], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 48


@pytest.mark.parametrize("name", ["none", "ngram", "medusa"])
def test_seeded_sampling_is_unchanged_by_preemption(tiny_pair, name):
    """A preempted request keeps its generator (nothing is sampled while it waits, and its
    recompute samples nothing): seeded sampled outputs equal the unpreempted run's."""
    prompts = shared_prompts(8)
    sampling = [SamplingParams(max_tokens=40, temperature=0.9, seed=100 + i) for i in range(8)]
    reference = [o.token_ids for o in engine(tiny_pair, paged_kv=False).generate(prompts, sampling, speculation(name))]
    small = engine(tiny_pair, num_kv_blocks=12)
    assert [o.token_ids for o in small.generate(prompts, sampling, speculation(name))] == reference
    assert small.stats()["preemptions"] > 0


def test_prompt_scores_are_computed_whatever_is_cached(tiny_pair):
    """A request that asks for its prompt's log-probabilities runs its whole prompt even when
    its prefix is cached (as vLLM does), and gets the scores an uncached engine gives."""
    prompt = shared_prompts(2)[1]
    scored = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    plain = engine(tiny_pair, paged_kv=False).generate([prompt], scored)[0]
    e = engine(tiny_pair)
    e.generate([prompt], GREEDY)  # caches the prompt's blocks
    before = e.stats()["kv"]["prefix_hits"]
    out = e.generate([prompt], scored)[0]
    assert e.stats()["kv"]["prefix_hits"] == before  # nothing taken from the cache
    assert out.token_ids == plain.token_ids
    for a, b in zip(out.prompt_logprobs, plain.prompt_logprobs):
        assert (a is None and b is None) or (a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) < 1e-4)
