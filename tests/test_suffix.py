"""Suffix decoding: the suffix trie against brute force, drafting (Arctic's rules), the global
tree (LRU, budgets, replicas of one log), lossless greedy and sampling, warming up on
repeated traffic, two engines sharing a tree, the controller, and every entry point (the
batch job that runs it: tests/test_batch_methods.py)."""

import collections
import copy
import random
import time

import numpy as np
import pytest
from pydantic import ValidationError

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies.base import CommitRow, PrefillRow, ProposalRow
from specray.policies.suffix import SuffixOptions, SuffixProposer, best_width
from specray.policies.suffix_cache import (GlobalSuffixCache, LocalTransport, ReplicatedSuffixCache, SuffixCacheConfig,
                                           SuffixCacheLog)
from specray.policies.suffix_tree import SuffixMatcher, SuffixTree, TreeDraft
from tests.conftest import decode, hf_greedy, tiny_llama
from tests.test_engine import GREEDY, ragged_prompts


def suffix(**kw):
    return SpeculationParams(method="suffix", **kw)


def engine_with(target, max_num_seqs=4, proposer=None, cache=None, **config):
    """An engine whose suffix proposer is ``proposer`` (or one over ``cache``, the global tree)."""
    if proposer is None and cache is not None:
        proposer = SuffixProposer(cache)
    proposers = {"suffix": lambda ctx: proposer} if proposer is not None else None
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, **config),
                     target_model=copy.deepcopy(target), proposers=proposers)


# -- the suffix trie -----------------------------------------------------------------------
def substring_counts(seqs, depth):
    counts = collections.Counter()
    for s in seqs:
        for j in range(len(s)):
            for n in range(1, depth + 1):
                if j + n <= len(s):
                    counts[tuple(s[j : j + n])] += 1
    return counts


def tree_counts(tree: SuffixTree) -> dict:
    """Every string the tree holds with its count, tails' implicit nodes included."""
    out = {}

    def walk(node, path):
        for tok, child in (node.children or {}).items():
            p = path + (tok,)
            out[p] = child.count
            if child.children is None:  # a tail: the single occurrence goes on implicitly
                pos = child.end
                while len(p) < tree.max_depth and pos < len(child.seq):
                    p, pos = p + (child.seq[pos],), pos + 1
                    out[p] = 1
            else:
                walk(child, p)

    walk(tree.root, ())
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("seed", range(40))
def test_trie_counts_equal_brute_force_through_interleaved_inserts_and_removals(seed):
    """Several sequences growing in turns (tails of open sequences made explicit by others),
    closed and removed: every string's count is its number of occurrences (up to the depth)."""
    rng = random.Random(seed)
    depth, vocab = rng.randint(2, 7), rng.choice([2, 3, 5])
    tree, seqs = SuffixTree(depth), {}
    for _ in range(25):
        op = rng.random()
        if op < 0.65 or not seqs:
            sid = rng.randrange(5)
            if sid in seqs and sid not in tree._active:
                continue  # closed
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
            tree.extend(sid, tokens)
            seqs.setdefault(sid, []).extend(tokens)
        elif op < 0.8:
            tree.close(rng.choice(list(seqs)))
        else:
            sid = rng.choice(list(seqs))
            tree.remove(sid)
            del seqs[sid]
        want = {k: v for k, v in substring_counts(seqs.values(), depth).items() if v}
        assert tree_counts(tree) == want
        assert tree.root.count == tree.num_tokens == sum(map(len, seqs.values())) and len(tree) == len(seqs)


def test_tails_keep_the_trie_linear_on_text_that_does_not_repeat():
    tree = SuffixTree(32)
    tree.extend("a", list(range(1000)))
    nodes = sum(1 for _ in _walk_nodes(tree.root))
    assert nodes == 1000  # one tail per position, not one node per (position, depth)


def _walk_nodes(node):
    for child in (node.children or {}).values():
        yield child
        yield from _walk_nodes(child)


@pytest.mark.parametrize("seed", range(20))
def test_matcher_finds_every_matching_suffix_incrementally(seed):
    rng = random.Random(100 + seed)
    depth, vocab = rng.randint(3, 7), rng.choice([2, 3])
    tree, seqs = SuffixTree(depth), []
    for sid in range(4):
        seqs.append([rng.randrange(vocab) for _ in range(rng.randint(1, 10))])
        tree.extend(sid, seqs[-1])
        tree.close(sid)
    counts = substring_counts(seqs, depth)
    matcher, context = SuffixMatcher(tree), []
    for step in range(15):
        context += [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        if step == 7:  # the tree changes: the matcher rebuilds from the context
            seqs.append(context[-4:] + [0, 1])
            tree.extend("new", seqs[-1])
            counts = substring_counts(seqs, depth)
        cursors = matcher.update(context)
        want = [n for n in range(1, min(len(context), depth - 1) + 1) if counts[tuple(context[-n:])]]
        assert [tree.depth(c) for c in cursors] == want
        assert [tree.count(c) for c in cursors] == [counts[tuple(context[-n:])] for n in want]


# -- drafting ------------------------------------------------------------------------------
def test_draft_expands_the_most_probable_paths_first():
    tree = SuffixTree(16)
    #            after [1, 2]: 3 (x3), 4 (x1); after [1, 2, 3]: 5 (x2), 6 (x1)
    tree.extend(0, [1, 2, 3, 5, 9, 1, 2, 3, 5, 9, 1, 2, 3, 6, 1, 2, 4, 0])
    cursor = tree.match([7, 1, 2])[-1]
    assert tree.depth(cursor) == 2 and tree.count(cursor) == 4
    d = tree.draft(cursor, max_nodes=4, min_prob=0.0)
    assert d.tokens == [3, 5, 9, 1] and d.parents == [0, 1, 2, 3]  # [.., 9] went on with 1 twice
    assert d.probs == pytest.approx([3 / 4, 2 / 4, 2 / 4, 2 / 4])
    assert d.score == pytest.approx(2.25) and d.match_len == 2
    # three levels at most: then the rarer branches, 4 (after [1, 2]) and 6 (after [1, 2, 3])
    d = tree.draft(cursor, max_nodes=5, min_prob=0.0, max_depth=3)
    assert d.tokens == [3, 5, 9, 4, 6] and d.parents == [0, 1, 2, 0, 1]
    # min_prob drops what falls below it: the chain ends where its two occurrences part
    assert tree.draft(cursor, 16, min_prob=0.3).tokens == [3, 5, 9, 1, 2, 3]
    path = tree.draft(cursor, 3, tree=False)
    assert path.tokens == [3, 5, 9] and path.parents == [0, 1, 2]
    # the cursor's own occurrence (a request's tail in its own tree) is not counted
    assert tree.draft(cursor, 1, exclude=1).probs == pytest.approx([3 / 3])


def test_proposer_follows_arctics_match_length_rule():
    """A match of m tokens drafts at most max_spec_factor * m + max_spec_offset tokens, and the
    best-scoring match wins."""
    prop = SuffixProposer(GlobalSuffixCache(max_tree_depth=32))
    text = [9, 8, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    tail = [50, 51, 3, 4]  # [3, 4] occurred once: a 2-token match
    row = ProposalRow(slot=0, token_ids=text + tail, num_tokens=16)
    assert prop.propose([row]).rows[0].tokens == [5, 6]
    opts = suffix(max_spec_factor=2.0, max_spec_offset=1.0)
    row = ProposalRow(slot=1, token_ids=text + tail, num_tokens=16, options=opts)
    assert prop.propose([row]).rows[0].tokens == [5, 6, 7, 8, 9]
    row = ProposalRow(slot=2, token_ids=text + tail, num_tokens=3, options=opts)  # the room to accept
    assert prop.propose([row]).rows[0].tokens == [5, 6, 7]
    row = ProposalRow(slot=3, token_ids=text + tail, num_tokens=16, width=2, options=opts)  # the KV room
    assert prop.propose([row]).rows[0].tokens == [5, 6]
    nothing = ProposalRow(slot=4, token_ids=[1, 2, 3, 4], num_tokens=16)
    assert prop.propose([nothing]).rows[0].tokens == []


def test_proposer_drafts_a_tree_of_the_frequent_continuations():
    prop = SuffixProposer()
    text = [1, 2, 3, 5, 1, 2, 3, 5, 1, 2, 4, 6, 0, 1, 2]
    opts = dict(min_token_prob=0.2, max_spec_factor=4.0)
    row = prop.propose([ProposalRow(slot=0, token_ids=text, num_tokens=8, options=suffix(**opts))]).rows[0]
    first_level = [t for t, p in zip(row.tokens, row.tree.parents.tolist()[1:]) if p == 0]
    assert row.tokens[:2] == [3, 5] and first_level == [3, 4]  # after [1, 2]: 3 twice, then 4 once
    path = prop.propose([ProposalRow(slot=1, token_ids=text, num_tokens=8, options=suffix(**opts, tree=False))]).rows[0]
    assert path.tree is None and path.tokens == [3, 5, 1, 2, 3, 5, 1, 2]  # the most frequent child each time


def test_the_width_rule_weighs_expected_tokens_against_the_cost_of_a_wider_step():
    sure, unsure = [1.0] * 10, [0.6, 0.3, 0.2, 0.1]
    assert best_width([sure], 64) == 10  # alone and sure: everything
    assert best_width([unsure], 64) == 4 and best_width([unsure], 16) == 3  # the 0.1 node: worth 1/64 of a step
    assert best_width([unsure] * 8, 64) == 3 and best_width([unsure] * 8, 16) == 1  # 8 rows pay for each unit
    assert best_width([[0.1]] * 8, 64) == 0  # nothing is worth its cost: no drafts
    # one sure row among eight: every unit of width costs the whole step B / step_cost_tokens more
    assert best_width([sure] + [[]] * 7, 128) == 10 and best_width([sure] + [[]] * 7, 32) == 0
    assert best_width([], 64) == 0
    # Through the proposer: the rows of a step are cut to one width, each keeping its most
    # probable nodes (whole paths: drafting order puts parents first).
    prop = SuffixProposer(step_cost_tokens=16)
    text = [1, 2, 3, 5, 9, 1, 2, 3, 5, 9, 1, 2, 4, 6, 7, 1, 2]
    rows = [ProposalRow(slot=s, token_ids=text, num_tokens=8, options=suffix(max_spec_factor=4.0)) for s in range(4)]
    alone = prop.propose(rows[:1]).rows[0]
    together = prop.propose(rows).rows
    assert len(alone.tokens) > len(together[0].tokens) > 0
    assert all(d.tokens == alone.tokens[: len(d.tokens)] for d in together)


def test_the_request_tree_follows_commits_and_slot_reuse():
    prop = SuffixProposer()
    prop.prefill([PrefillRow(0, [4, 5, 6, 4, 5], 6)])
    assert prop.propose([ProposalRow(slot=0, token_ids=[4, 5, 6, 4, 5, 6], num_tokens=4)]).rows[0].tokens[:2] == [4, 5]
    prop.commit([CommitRow(0, [4, 5, 9], [0, 1, 2])])
    assert prop._rows[0].output == [6, 4, 5, 9]
    # a new request in the same slot without a release: its own tree starts over
    assert prop.propose([ProposalRow(slot=0, token_ids=[7, 8, 4, 5], num_tokens=4)]).rows[0].tokens == []
    prop.release(0)
    prop.release(99)  # unknown slot: no error


# -- the global tree -----------------------------------------------------------------------
def test_global_tree_is_lru_bounded_and_inserts_within_a_budget():
    cache = GlobalSuffixCache(max_tree_depth=8, max_cached_requests=2, insert_tokens_per_poll=10)
    ids = [cache.add([i, i + 1, i + 2, i + 3, i + 4, i + 5]) for i in (0, 10, 20)]
    cache.poll()  # 6 tokens, then 12 > 10: the second waits
    assert cache.cached() == ids[:1]
    cache.poll()
    cache.poll()
    assert cache.cached() == ids[1:]  # the first was evicted (two at most)
    cache.touch(ids[1])
    cache.add([30, 31])
    cache.poll()
    assert cache.cached() == [ids[1], 3] and not cache.tree.match([20, 21])  # the untouched one went
    assert cache.add([10, 11, 12, 13, 14, 15]) == ids[1]  # a retry's answer, already cached: touched
    cache.poll()
    assert cache.cached() == [3, ids[1]] and len(cache.tree) == 2
    assert GlobalSuffixCache(max_cached_requests=0).enabled is False
    with pytest.raises(ValueError, match="max_cached_requests"):
        GlobalSuffixCache(max_cached_requests=-1)


def test_replicas_of_one_log_see_each_others_outputs_and_evictions():
    log = SuffixCacheLog(max_cached_requests=3, log_limit=4)
    a, b = (ReplicatedSuffixCache(LocalTransport(log), max_tree_depth=8, sync_every_requests=2,
                                  sync_interval_s=3600) for _ in range(2))

    def held(replica):
        return {tuple(replica.tree.sequence(s)) for s in replica.tree.sids()}

    a.poll()
    b.poll()  # the first exchanges (due at once): nothing yet
    a.add([1, 2, 3, 4])
    a.poll()
    assert held(a) == {(1, 2, 3, 4)} and log.stats()["cached"] == 0  # in a's tree at once, sent every 2
    a.add([5, 6, 7, 8])
    a.poll()
    assert log.stats()["cached"] == 2
    b.add([9, 9, 9])
    b.add([4, 3, 2])
    b.poll()  # b sends its two and receives a's, and that the log (3 at most) evicted a's first
    assert held(b) == {(5, 6, 7, 8), (9, 9, 9), (4, 3, 2)} and log.stats()["cached"] == 3
    b.touch(next(s for s in b.tree.sids() if b.tree.sequence(s) == [4, 3, 2]))  # drafted from: sent next time
    a.add([7, 7])
    a.add([6, 6])
    a.poll()  # the log evicts two more; a's cursor fell behind its 4 events: a snapshot
    assert held(a) == {(4, 3, 2), (7, 7), (6, 6)} and log.stats()["cached"] == 3
    b.add([1, 1])
    b.add([2, 2])
    b.poll()  # b's touch kept [4, 3, 2]; b applies the evictions it hears of
    assert held(b) == {(4, 3, 2), (1, 1), (2, 2)}

    # the log is lost: a new one gets this replica's own outputs again
    fresh = SuffixCacheLog(max_cached_requests=3)
    a.transport = LocalTransport(fresh)
    a._lost()
    a._last = float("-inf")
    a.poll()
    assert fresh.stats()["cached"] == 2 and held(a) == {(7, 7), (6, 6)}


def test_suffix_cache_config_is_checked():
    from specray.actors.suffix_cache import default_name

    assert SuffixCacheConfig().max_tree_depth == 32 and SuffixCacheConfig().name is None
    assert default_name("a|b") == default_name("a|b") != default_name("a|c")
    for field, bad in (("max_tree_depth", 2), ("max_cached_requests", -1), ("sync_every_requests", 0),
                       ("sync_interval_s", 0), ("name", "")):
        with pytest.raises(ValidationError, match=field):
            SuffixCacheConfig(**{field: bad})
    with pytest.raises(ValidationError, match="max_tree_dept"):
        SuffixCacheConfig(max_tree_dept=8)
    # an engine's tree: a replica of the shared actor's, or (not shared, or no cache) one of its own
    from specray.actors.suffix_cache import suffix_cache_for

    assert isinstance(suffix_cache_for({}, "m"), ReplicatedSuffixCache)
    assert type(suffix_cache_for({"shared": False}, "m")) is GlobalSuffixCache
    assert type(suffix_cache_for({"max_cached_requests": 0}, "m")) is GlobalSuffixCache


# -- options -------------------------------------------------------------------------------
def test_options_defaults_and_validation(make_engine):
    o = suffix()
    assert isinstance(o, SuffixOptions) and o.num_speculative_tokens == 16 and o.max_spec_factor == 1.0
    assert o.min_token_prob == 0.1 and o.tree is True and o.budget == 16
    for field, bad in (("num_speculative_tokens", 0), ("max_spec_factor", -1), ("min_token_prob", 1.5),
                       ("max_spec_offset", 100), ("tree", "sometimes")):
        with pytest.raises(ValidationError, match=field):
            suffix(**{field: bad})
    with pytest.raises(ValidationError, match="max_spec_facto"):
        suffix(max_spec_facto=2)
    engine = make_engine(max_num_seqs=1, draft=False, max_model_len=32)
    with pytest.raises(ValueError, match="num_speculative_tokens 40 does not fit the 32-token context"):
        engine.add_request([1, 2, 3], GREEDY, suffix(num_speculative_tokens=40))
    with pytest.raises(ValueError, match="never drafts"):
        engine.add_request([1, 2, 3], GREEDY, suffix(max_spec_factor=0))
    engine.add_request([1, 2, 3], GREEDY, suffix(max_spec_factor=0, max_spec_offset=4))


# -- lossless greedy -----------------------------------------------------------------------
SPECS = [suffix(), suffix(num_speculative_tokens=6, min_token_prob=0.0), suffix(tree=False),
         suffix(max_spec_factor=3.0, max_spec_offset=2.0, num_speculative_tokens=24)]


@pytest.mark.parametrize("spec", range(len(SPECS)))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_hf_generate(tiny_pair, references, spec, batch):
    engine = engine_with(tiny_pair[0], max_num_seqs=batch)
    prompts = ragged_prompts(8 if batch > 1 else 3)  # 8 ragged prompts through 4 slots: joins mid-way
    for _ in range(2):  # the second round drafts from the first's outputs too
        outs = engine.generate(prompts, GREEDY, SPECS[spec])
        assert [o.token_ids for o in outs] == references[: len(prompts)]
    t = engine.totals
    assert t.num_drafts > 0 and 0 < t.num_accepted_tokens


def test_mixed_with_other_methods_in_one_batch(tiny_pair, references):
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(tiny_pair[0]),
                       draft_model=copy.deepcopy(tiny_pair[1]))
    specs = [suffix(), SpeculationParams(method="draft", num_speculative_tokens=3), suffix(tree=False),
             SpeculationParams(method="ngram"), SpeculationParams(method="none"),
             SpeculationParams(method="lookahead"), suffix(num_speculative_tokens=4), suffix()]
    for _ in range(2):
        outs = engine.generate(ragged_prompts(8), GREEDY, specs)
        assert [o.token_ids for o in outs] == references
    assert sum(o.metrics["num_drafts"] for o, s in zip(outs, specs) if s.method == "suffix") > 0


def test_near_the_end_of_the_context_drafts_shrink_to_the_room(tiny_pair):
    target = tiny_pair[0]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 2, [2, 7, 1, 8] * 3]
    engine = engine_with(target, 2, max_model_len=32)
    for _ in range(2):
        outs = engine.generate(prompts, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                               suffix(num_speculative_tokens=12, max_spec_factor=4.0))
        for p, o in zip(prompts, outs):
            assert o.finish_reason == "length" and o.token_ids == hf_greedy(target, p, 32 - len(p))


# -- the global tree warms up --------------------------------------------------------------
LONG = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def rounds(prompts, outputs, cut):
    """Re-asked prompts that repeat part of an earlier answer: the prompt and the answer's
    first ``cut`` tokens (the target then writes the rest of that answer again)."""
    return [p + o[:cut] for p, o in zip(prompts, outputs)]


def accepted_length(outs) -> float:
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    return 1 + sum(o.metrics["num_accepted_tokens"] for o in outs) / max(drafts, 1)


def tokens_per_forward(outs) -> float:
    return sum(len(o.token_ids) for o in outs) / sum(o.metrics["target_forward_passes"] for o in outs)


@pytest.fixture(scope="module")
def workload(tiny_pair):
    prompts = [p[:12] for p in ragged_prompts(8, seed=5)]
    return prompts, [hf_greedy(tiny_pair[0], p, LONG.max_tokens) for p in prompts]


def test_accepted_length_grows_as_the_global_tree_warms(tiny_pair, workload):
    prompts, answers = workload
    spec = suffix(num_speculative_tokens=8)
    warm = engine_with(tiny_pair[0], 4)
    cold = engine_with(tiny_pair[0], 4, cache=GlobalSuffixCache(max_cached_requests=0))  # own trees only
    first = warm.generate(prompts, LONG, spec)
    assert [o.token_ids for o in first] == answers
    seen = []
    for cut in (4, 8, 12):
        asked = rounds(prompts, answers, cut)
        want = [hf_greedy(tiny_pair[0], p, LONG.max_tokens) for p in asked]
        outs = {name: e.generate(asked, LONG, spec) for name, e in (("warm", warm), ("cold", cold))}
        for o in outs.values():
            assert [x.token_ids for x in o] == want
        seen.append((tokens_per_forward(outs["warm"]), tokens_per_forward(outs["cold"])))
    first_rate = tokens_per_forward(first)
    # The global tree holds the earlier answers: re-asked prompts continue them, drafted whole;
    # a request's own tree alone (cold) does not know them.
    assert all(w > 1.5 * c and w > 1.5 * first_rate for w, c in seen), (first_rate, seen)
    assert seen[-1][0] >= 2.5, seen


@pytest.mark.parametrize("layout", ["one object", "replicas of one log"])
def test_two_engines_sharing_a_global_tree_both_benefit(tiny_pair, workload, layout):
    prompts, answers = workload
    spec = suffix(num_speculative_tokens=8)
    if layout == "one object":
        shared = GlobalSuffixCache()
        caches = [shared, shared]
    else:
        log = SuffixCacheLog()
        caches = [ReplicatedSuffixCache(LocalTransport(log), sync_every_requests=1, sync_interval_s=0.0)
                  for _ in range(2)]
    a, b = (engine_with(tiny_pair[0], 4, cache=c) for c in caches)
    alone = engine_with(tiny_pair[0], 4)  # its own global tree, which never saw the others' answers
    half = len(prompts) // 2
    mine, theirs = (prompts[:half], answers[:half]), (prompts[half:], answers[half:])
    a.generate(mine[0], LONG, spec)  # each engine answers its half first ...
    b.generate(theirs[0], LONG, spec)
    alone.generate(mine[0], LONG, spec)
    # ... then is re-asked the other half's answers
    got = {}
    for name, engine, (p, o) in (("a", a, theirs), ("b", b, mine), ("alone", alone, theirs)):
        outs = engine.generate(rounds(p, o, 8), LONG, spec)
        assert [x.token_ids for x in outs] == [hf_greedy(tiny_pair[0], q, LONG.max_tokens) for q in rounds(p, o, 8)]
        got[name] = tokens_per_forward(outs)
    assert got["a"] > 1.5 * got["alone"] and got["b"] > 1.5 * got["alone"], got


# -- sampling ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampling_setup():
    from tests.test_sampling_e2e import exact_joint

    target = tiny_llama(vocab=8, seed=3, init=0.25)
    return target, exact_joint(target)


def _sample(target, spec):
    """N seeded requests of 4 tokens (test_sampling_e2e's prompt and parameters); the global
    tree fills with the earlier requests' samples as they finish."""
    from tests.test_sampling_e2e import N, PARAMS, PROMPT

    engine = engine_with(target, 64, SuffixProposer(step_cost_tokens=None))  # every row its whole draft
    outs = engine.generate([PROMPT] * N, [SamplingParams(seed=i, **PARAMS) for i in range(N)], spec)
    t = engine.totals
    assert t.num_drafts > N // 2 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    assert t.accepted_per_pos[1] > 0  # multi-token drafts fully accepted too
    return np.array([o.token_ids for o in outs])


SAMPLED = [suffix(num_speculative_tokens=6, min_token_prob=0.0), suffix(num_speculative_tokens=3, tree=False)]


@pytest.mark.parametrize("spec", SAMPLED, ids=["tree", "path"])
def test_sampling_keeps_the_target_distribution(sampling_setup, spec):
    from tests.test_sampling_e2e import check

    target, joint = sampling_setup
    pvals = check(_sample(target, spec), joint)
    assert min(pvals) > 1e-3, pvals


def test_the_sampling_check_catches_a_lossy_rule_on_suffix_drafts(sampling_setup, monkeypatch):
    from tests.test_lookahead import _lossy_tree_accept
    from tests.test_sampling_e2e import check

    target, joint = sampling_setup
    monkeypatch.setattr("specray.engine.accept.tree_rejection_accept", _lossy_tree_accept)
    assert min(check(_sample(target, SAMPLED[0]), joint)) < 1e-3


# -- the verification budget -------------------------------------------------------------------
def modeled_costs(budget):
    """The budget with steps costing what the tiny pair's steps measure at batch 8 (4 ms, 0.5 ms a
    draft node), not the clock's reading: loaded cores must not decide these tests."""
    from dataclasses import replace

    observe = budget.observe
    budget.observe = lambda step: observe(replace(step, propose_s=0.0, verify_s=0.004 + 0.0005 * max(step.drafted)))
    return budget


def test_the_budget_keeps_suffix_on_where_it_pays_and_off_where_it_does_not(tiny_pair, workload):
    """Requests that leave the options to the engine: under the verification budget suffix
    drafting is on for re-asked prompts (the global tree knows their answers) and off (bar an
    exploration step now and then) on traffic it cannot predict, where verifying its guesses
    would only cost."""
    from specray.policies.budget import VerificationBudget

    prompts, answers = workload
    engine = engine_with(tiny_pair[0], 8, profile_costs=False)  # (costs: the model's alone)
    assert isinstance(engine.driver.length_policy, VerificationBudget)
    modeled_costs(engine.driver.length_policy)
    engine.generate(prompts, LONG, suffix())
    on = engine.generate(rounds(prompts, answers, 8) * 2, LONG, suffix())
    assert tokens_per_forward(on) > 2.0

    class Wrong(SuffixProposer):  # confident drafts that are never right: pure verification cost
        def propose(self, rows):
            draft = super().propose(rows)
            for r, d in zip(rows, draft.rows):
                d.tokens[:] = [(t + 1) % 64 for t in r.token_ids[-8:]][: max(1, r.num_tokens)]
            return draft

    costly = engine_with(tiny_pair[0], 8, proposer=Wrong(), profile_costs=False)
    modeled_costs(costly.driver.length_policy)
    outs = costly.generate(ragged_prompts(8, seed=9) * 3, LONG, suffix())
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    steps = max(o.metrics["target_forward_passes"] for o in outs)
    # Off most of the time: each of the 24 requests starts from the method's estimate and is
    # explored by its posterior draws (27% of row-steps drafted here), never on for long.
    assert drafts < 8 * steps * 3 / 3


# -- entry points: coordinator (both layouts), two deployments sharing one tree actor -------
ACTOR_SPECS = [{"method": "suffix"}, {"method": "suffix", "num_speculative_tokens": 6, "min_token_prob": 0.0},
               {"method": "ngram"}, {"method": "suffix", "tree": False}, {"method": "none"}]


def test_suffix_through_the_coordinator(tiny_coordinator, tiny_pair):
    """The separate layout: suffix drafts beside the target, in the engine worker (colocated:
    test_colocated_tp2_every_method, the engine tests)."""
    import ray

    from tests.test_actors import GREEDY as ACTOR_GREEDY, PROMPTS

    c = tiny_coordinator
    refs = [hf_greedy(tiny_pair[0], p, ACTOR_GREEDY["max_tokens"]) for p in PROMPTS]
    for _ in range(2):  # the second time, the global tree knows the answers
        outs = ray.get(c.generate.remote(PROMPTS, ACTOR_GREEDY, ACTOR_SPECS))
        assert [o["token_ids"] for o in outs] == refs
    # The rows that set their options draft every step; the default row's length is the budget's,
    # which reads no confidence from the suffix tree yet and may keep it plain after a first
    # round of misses (its output is checked above all the same).
    assert all(o["metrics"]["num_accepted_tokens"] > 0 for o, s in zip(outs, ACTOR_SPECS)
               if s["method"] == "suffix" and len(s) > 1)
    workers = ray.get(c.workers.remote())
    assert "suffix" not in workers  # drafted beside the target, in the engine worker, in both layouts
    engine = workers["target"]
    assert ray.get(engine.describe.remote())["proposers"]["suffix"].endswith("SuffixProposer")
    with pytest.raises(ValueError, match="min_token_prob"):
        ray.get(c.generate.remote([[1, 2]], ACTOR_GREEDY, {"method": "suffix", "min_token_prob": 2}))



def test_two_deployments_sharing_the_tree_actor_both_benefit(tiny_colocated_coordinator, tiny_checkpoints,
                                                             tiny_methods, tiny_pair, workload):
    """Two coordinators (two engine workers, as two Serve replicas have) with one tree actor:
    each is re-asked the answers the other one gave, and drafts them from its replica of the
    shared tree; a third, the session's colocated coordinator, whose tree is another one (its
    model names a tokenizer too: another default name), does not know them."""
    import time

    import ray

    from specray.actors.coordinator import Coordinator
    from specray.actors.suffix_cache import default_name, drop_shared_suffix_cache, shared_suffix_cache
    from tests.serving import cpu_placement
    from tests.test_actors import shutdown

    prompts, answers = workload
    greedy = {"max_tokens": LONG.max_tokens, "temperature": 0, "ignore_eos": True}
    base = {**tiny_checkpoints, "max_num_seqs": 4, "placement": cpu_placement("colocated")}
    name = default_name(f"{tiny_checkpoints['target']}|None")  # no name given: one tree per model
    assert name != default_name(f"{tiny_methods['target']}|{tiny_methods['tokenizer']}")  # the third's tree
    shared = {"sync_every_requests": 1, "sync_interval_s": 0.05}
    a, b = (Coordinator.remote({**base, "suffix_cache": shared}) for _ in range(2))
    alone = tiny_colocated_coordinator
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    half = len(prompts) // 2
    try:
        ray.get([a.generate.remote(prompts[:half], greedy, spec), b.generate.remote(prompts[half:], greedy, spec),
                 alone.generate.remote(prompts[half:], greedy, spec)])
        deadline = time.monotonic() + 30
        while (log := shared_suffix_cache(name)) is None or ray.get(log.stats.remote())["cached"] < len(prompts):
            assert time.monotonic() < deadline, "the replicas' outputs did not reach the tree actor"
            time.sleep(0.05)
        got = {}
        for key, c, part in (("a", a, slice(half, None)), ("b", b, slice(None, half)), ("alone", alone, slice(None, half))):
            asked = rounds(prompts[part], answers[part], 8)
            outs = [SimpleOut(o) for o in ray.get(c.generate.remote(asked, greedy, spec))]
            assert [o.token_ids for o in outs] == [hf_greedy(tiny_pair[0], q, LONG.max_tokens) for q in asked]
            got[key] = tokens_per_forward(outs)
        assert got["a"] > 1.5 * got["alone"] and got["b"] > 1.5 * got["alone"], got
    finally:
        for c in (a, b):
            shutdown(c)
        drop_shared_suffix_cache(name)


class SimpleOut:
    """A coordinator's output dict read like a ``RequestOutput``."""

    def __init__(self, d: dict):
        self.token_ids, self.metrics = d["token_ids"], d["metrics"]


# -- entry points: batch jobs, CLI, HTTP ---------------------------------------------------
def test_a_batch_job_refuses_bad_suffix_lines(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    """Every bad line named, before anything starts (suffix's lines that run:
    tests/test_batch_methods.py); a suffix tree config is checked as it loads."""
    from specray.actors.config import SpecrayConfig
    from specray.entrypoints import jobs

    config = tmp_path / "specray.yaml"
    config.write_text(f"target: {tiny_checkpoints['target']}\nmax_num_seqs: 3\n"
                      "default_speculation:\n  method: suffix\nplacement:\n  mode: colocated\n"
                      "suffix_cache:\n  name: suffix-test-jobs\n  max_tree_depth: 16\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1], "speculation": {"method": "suffix", "min_token_prob": -1}}\n'
                   '{"prompt": [1], "speculation": {"method": "suffix", "max_spec_facto": 2}}\n')
    monkeypatch.setattr("specray.actors.coordinator.Coordinator", None)  # any use of it fails
    assert jobs.main(["--input", str(bad), "--output", str(tmp_path / "o2.jsonl"), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "line 1:" in err and "min_token_prob" in err and "line 2:" in err and "max_spec_facto" in err
    with pytest.raises(ValidationError, match="max_tree_depth"):
        SpecrayConfig(suffix_cache={"max_tree_depth": 1})


def test_cli_flags_come_from_the_options(capsys):
    from specray.entrypoints.cli import build_parser, main, request_speculation

    p, flags = build_parser()
    args = p.parse_args(["generate", "--prompt", "x", "--method", "suffix", "--num-speculative-tokens", "12",
                         "--max-spec-factor", "2.5", "--max-spec-offset", "-1", "--min-token-prob", "0.2",
                         "--no-suffix-tree"])
    assert request_speculation(args, flags) == suffix(num_speculative_tokens=12, max_spec_factor=2.5,
                                                      max_spec_offset=-1, min_token_prob=0.2, tree=False)
    assert request_speculation(p.parse_args(["generate", "--prompt", "x", "--method", "suffix"]), flags) == SuffixOptions()
    assert main(["generate", "--prompt", "x", "--method", "suffix", "--min-token-prob", "2"]) == 2
    assert "--min-token-prob 2" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_generate_with_suffix_equals_plain(demo_pair, capsys):
    import json

    from specray.entrypoints.cli import main

    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef"
    common = ["generate", "--prompt", prompt, "--max-tokens", "32", "--json"]
    assert main([*common, "--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "suffix", "--num-speculative-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain["token_ids"] and out["metrics"]["num_drafts"] > 0


def test_suffix_over_http(colocated_url, tiny_pair):
    """Two replicas, one tree (its actor): once a replica's sync has pulled the other's answers,
    whichever replica answers drafts this one from them."""
    import httpx
    import openai

    from tests.serving import COLOCATED, assert_openai_error

    client = openai.OpenAI(base_url=f"{colocated_url}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4]
    ref = decode(hf_greedy(tiny_pair[0], prompt, 20))
    for spec in ({"method": "suffix"}, {"method": "suffix", "num_speculative_tokens": 6, "max_spec_factor": 2,
                                        "min_token_prob": 0.05, "tree": False}):
        for _ in range(2):  # two replicas, one shared tree: the second answer is drafted
            r = client.completions.create(model=COLOCATED, prompt=prompt, max_tokens=20, temperature=0,
                                          extra_body={"speculation": spec})
            assert r.choices[0].text == ref, spec
    # Replicas pull each other's outputs every sync_interval_s: ask until a pull has landed (a
    # readiness wait; every answer stays exact meanwhile).
    deadline, accepted = time.monotonic() + 300, 0
    while not accepted and time.monotonic() < deadline:
        time.sleep(1)
        r = client.completions.create(model=COLOCATED, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"speculation": spec})
        assert r.choices[0].text == ref
        accepted = r.model_dump()["speculation_metrics"][0]["num_accepted_tokens"]
    assert accepted > 0
    stream = client.completions.create(model=COLOCATED, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"speculation": {"method": "suffix"}})
    assert "".join(ch.choices[0].text for ch in stream) == ref
    url = f"{colocated_url}/v1/completions"
    body = {"model": COLOCATED, "prompt": prompt, "max_tokens": 4, "speculation": {"method": "suffix",
                                                                                  "min_token_prob": 2}}
    assert_openai_error(httpx.post(url, json=body, timeout=60), 400, "min_token_prob")
    body["speculation"] = {"method": "suffix", "num_speculative_tokens": 100}
    assert_openai_error(httpx.post(url, json=body, timeout=60), 400, "64-token context")
