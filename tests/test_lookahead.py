"""Lookahead decoding: lossless greedy and sampling, the window's mask, the Jacobi window and
its n-gram pool, room limits, and every entry point (engine, coordinator, jobs, CLI, HTTP; the
batch job that runs lookahead: tests/test_batch_methods.py)."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from specray.engine import step as S
from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.runner import ModelRunner
from specray.kernels.tree_acceptance import TreeAcceptance
from specray.policies.base import CommitRow, ProposalRow
from specray.policies.lookahead import JacobiWindow, LookaheadOptions, LookaheadProposer, NgramPool, pack_candidates
from tests.conftest import decode, hf_greedy, tiny_llama
from tests.test_engine import GREEDY, ragged_prompts

CONFIGS = [(2, 2, 1), (4, 3, 4), (5, 4, 3), (3, 6, 7)]


def lookahead(w=4, n=3, g=4, **kw):
    return SpeculationParams(method="lookahead", window_size=w, ngram_size=n, verification_set_size=g, **kw)


def engine_with(target, max_num_seqs=4, proposer=None, **config):
    proposers = {"lookahead": lambda ctx: proposer} if proposer is not None else None
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, **config),
                     target_model=copy.deepcopy(target), proposers=proposers)


# -- options -------------------------------------------------------------------------------
def test_options_defaults_and_validation(make_engine):
    o = SpeculationParams(method="lookahead")
    assert isinstance(o, LookaheadOptions) and o.window_size >= 2 and o.ngram_size >= 2
    assert o.verification_set_size >= 1 and o.shared_pool is False and o.budget is None
    assert lookahead(5, 4, 3).tokens_per_step == 5 * 3 + 3 * 3
    for field, bad in (("window_size", 1), ("ngram_size", 1), ("verification_set_size", 0)):
        with pytest.raises(ValidationError, match=field):
            SpeculationParams(method="lookahead", **{field: bad})
    with pytest.raises(ValidationError, match="shared_pol"):
        SpeculationParams(method="lookahead", shared_pol=True)
    engine = make_engine(max_num_seqs=1, draft=False, max_model_len=32)
    with pytest.raises(ValueError, match=r"window_size x \(ngram_size - 1\).*= 36 .*32-token context"):
        engine.add_request([1, 2, 3], GREEDY, lookahead(8, 4, 4))
    engine.add_request([1, 2, 3], GREEDY, lookahead(6, 3, 4))  # 20 tokens per step fit


# -- lossless greedy -----------------------------------------------------------------------
@pytest.mark.parametrize("w, n, g", CONFIGS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_hf_generate(tiny_pair, references, w, n, g, batch):
    engine = engine_with(tiny_pair[0], max_num_seqs=batch)
    prompts = ragged_prompts(8 if batch > 1 else 3)  # 8 ragged prompts through 4 slots: joins mid-way
    outs = engine.generate(prompts, GREEDY, lookahead(w, n, g))
    assert [o.token_ids for o in outs] == references[: len(prompts)]
    t = engine.totals
    assert t.num_drafts > 0 and t.num_accepted_tokens > 0
    assert max(len(o.token_ids) for o in outs) < t.target_forward_passes < sum(len(o.token_ids) for o in outs)


def test_mixed_with_other_methods_in_one_batch(tiny_pair, references):
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(tiny_pair[0]),
                       draft_model=copy.deepcopy(tiny_pair[1]))
    specs = [lookahead(), SpeculationParams(method="draft", num_speculative_tokens=3),
             lookahead(3, 5, 2, shared_pool=True), SpeculationParams(method="ngram"),
             SpeculationParams(method="none"), lookahead(2, 2, 1), lookahead(shared_pool=True), lookahead(6, 4, 6)]
    outs = engine.generate(ragged_prompts(8), GREEDY, specs)
    assert [o.token_ids for o in outs] == references
    assert all(o.metrics["num_drafts"] > 0 for o, s in zip(outs, specs) if s.method == "lookahead")


def test_default_options_keep_drafting_under_the_self_tuning_controller(tiny_pair, references):
    """Default (W, N, G) count as given: the speculation-length controller (the engine's
    default policy) leaves lookahead on in every step, also while the window fills the pool."""
    calls = []

    class Counting(LookaheadProposer):
        def propose(self, rows):
            calls.append(len(rows))
            return super().propose(rows)

    assert SpeculationParams(method="lookahead").model_fields_set >= {"window_size", "ngram_size",
                                                                      "verification_set_size"}
    engine = engine_with(tiny_pair[0], 1, Counting())
    out = engine.generate([ragged_prompts(8)[3]], GREEDY, SpeculationParams(method="lookahead"))[0]
    assert out.token_ids == references[3]
    # Every verification step but the last (one token left: nothing to draft) proposed.
    assert len(calls) >= out.metrics["target_forward_passes"] - 2 and out.metrics["num_drafts"] > 0


def test_small_room_gets_a_smaller_window_not_an_error(tiny_pair):
    """Near the end of the context and of max_tokens, and under a speculation-length cap,
    candidates and window shrink to the room the step has; the output stays the target's."""
    from specray.policies.spec_length import SpeculationLengthPolicy

    target = tiny_pair[0]
    seen = []

    class Recording(LookaheadProposer):
        def propose(self, rows):
            draft = super().propose(rows)
            seen.extend((r.width, r.num_tokens, d.size + len(d.extra.tokens if d.extra else []), d.structure.max_depth)
                        for r, d in zip(rows, draft.rows))
            return draft

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]
    engine = engine_with(target, 2, Recording(), max_model_len=32)
    outs = engine.generate(prompts, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), lookahead(5, 4, 4))
    for p, o in zip(prompts, outs):
        assert o.finish_reason == "length" and len(p) + len(o.token_ids) == 32
        assert o.token_ids == hf_greedy(target, p, 32 - len(p))
    assert all(nodes <= width and depth <= k for width, k, nodes, depth in seen)
    assert any(width < lookahead(5, 4, 4).tokens_per_step for width, *_ in seen)  # the room really was short
    capped = engine_with(target, 2, speculation_length=SpeculationLengthPolicy(batch_k_caps=((1, 1),)))
    outs = capped.generate(prompts, GREEDY, lookahead(5, 4, 4))
    assert [o.token_ids for o in outs] == [hf_greedy(target, p, GREEDY.max_tokens) for p in prompts]
    t = capped.totals
    assert 0 < t.num_drafts and t.num_draft_tokens <= 4 * t.num_drafts and t.num_accepted_tokens <= t.num_drafts


# -- the mask ------------------------------------------------------------------------------
def _window_sequences(window: JacobiWindow, cols: int, root: int) -> list[tuple[int, list[int]]]:
    """Each window token's own sequence after the root, by the lookahead-decoding definition
    (level 0 up to its column, then its column's history up its level), in feeding order."""
    level0 = window.levels[0]
    out = [(level0[c - 1], level0[:c]) for c in range(1, cols)]
    for level in range(1, len(window.levels)):
        for j in range(cols):
            out.append((window.levels[level][j], level0[:j] + [window.levels[lv][j] for lv in range(1, level + 1)]))
    return [(tok, [root] + seq) for tok, seq in out]


def test_window_and_candidate_logits_equal_their_own_prefix_run_sequentially():
    ref = tiny_llama()
    runner = ModelRunner(copy.deepcopy(ref), num_slots=3, capacity=128)
    prop = LookaheadProposer()
    opts = LookaheadOptions(window_size=3, ngram_size=4, verification_set_size=3)
    # Pooled continuations of the root 7 with a shared prefix (1, ...): a branching tree.
    seqs = [[7, 1, 2, 3, 9, 7, 1, 5, 9, 11, 7, 4, 4, 4, 12, 7], [20, 21, 22, 23, 20, 21, 30, 20]]
    slots = [2, 0]

    def rows(seqs):
        return [ProposalRow(slot=s, token_ids=t, num_tokens=3, options=opts) for s, t in zip(slots, seqs)]

    # Fill the first row's window (N - 2 = 2 steps) with made-up Jacobi outputs; the second
    # row starts later, so it is verified while still filling (a wider level 0).
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        draft = prop.propose(rows(seqs[:1])).rows[0]
        prop.commit([CommitRow(slots[0], [5], [0], extra_best=torch.randint(0, 64, (len(draft.extra.tokens),),
                                                                             generator=g).tolist())])
    windows = [copy.deepcopy(prop.window(slots[0]))]
    drafts = prop.propose(rows(seqs)).rows
    windows.append(copy.deepcopy(prop.window(slots[1])))
    assert windows[0].full and not windows[1].full
    assert drafts[0].tree.size == 1 + 8 and drafts[0].tokens[:3] == [4, 4, 4]  # (4,4,4), (1,5,9), (1,2,3) share "1"

    runner.forward(slots, [s[:-1] for s in seqs])  # the cache holds everything but the roots
    batch = [SimpleNamespace(output_ids=[s[-1]]) for s in seqs]
    inputs = S.verify_inputs(batch, drafts)
    out = runner.forward(slots, inputs.tokens, inputs.logits_at, inputs.layout)
    checked = 0
    for i, (seq, draft, window) in enumerate(zip(seqs, drafts, windows)):
        root, t = seq[-1], draft.structure
        expected = []  # (node index in the row, its own sequence after the prefix)
        for node in range(t.size):
            path, n = [], node
            while n > 0:
                path.append(draft.tokens[n - 1])
                n = int(t.parents[n])
            expected.append((node, [root] + path[::-1]))
        cols = window.columns  # the whole window fits here
        for k, (tok, own) in enumerate(_window_sequences(window, cols, root)):
            assert draft.extra.tokens[k] == tok
            expected.append((t.size + k, own))
        assert len(expected) == len(inputs.tokens[i])
        for node, own in expected:
            with torch.no_grad():
                want = ref(torch.tensor([seq[:-1] + own])).logits[0, -1]
            torch.testing.assert_close(out.logits[i, node], want, atol=1e-5, rtol=0)
            checked += 1
    assert checked == sum(len(t) for t in inputs.tokens)


# -- the Jacobi window and the pool ----------------------------------------------------------
def test_window_fills_then_harvests_the_diagonals_its_levels_imply():
    w = JacobiWindow(width=3, ngram=4, start=[10, 11, 12, 13])  # W + N - 3 = 4 level-0 tokens
    assert not w.full and w.columns == 5 and w.size(5) == 4
    assert w.advance(root=1, out=[20, 21, 22, 23, 24]) == []  # filling: level 1 arrives
    assert w.levels == [[11, 12, 13], [21, 22, 23, 24]] and w.columns == 4
    assert w.outputs(4, root_next=99, best=[0, 0, 0, 30, 31, 32, 33]) == [30, 31, 32, 33]
    assert w.advance(root=2, out=[30, 31, 32, 33]) == []  # level 2 arrives: full, W columns
    assert w.full and w.levels == [[12, 13], [22, 23, 24], [31, 32, 33]] and w.size(3) == 2 + 3 + 3
    # Full: column j's diagonal (level 0[j], level 1[j], level 2[j], out[j]), level 0's
    # column 0 being the root.
    harvest = w.advance(root=5, out=[40, 41, 42])
    assert harvest == [(5, (22, 31, 40)), (12, (23, 32, 41)), (13, (24, 33, 42))]
    assert w.levels == [[23, 24], [31, 32, 33], [40, 41, 42]]  # one Jacobi iteration on
    # A narrowed step (2 of 3 columns ran): harvest those, the last column keeps its level.
    assert w.advance(root=6, out=[50, 51]) == [(6, (31, 40, 50)), (23, (32, 41, 51))]
    assert w.levels == [[32, 33], [40, 41, 42], [50, 51, 42]]
    n2 = JacobiWindow(width=3, ngram=2, start=[7, 8])  # N = 2: full from the start, 2-grams
    assert n2.full and n2.outputs(3, root_next=60, best=[61, 62]) == [60, 61, 62]
    assert n2.advance(root=9, out=[60, 61, 62]) == [(9, (60,)), (7, (61,)), (8, (62,))]
    assert n2.levels == [[61, 62]]


def test_proposer_pools_what_the_window_harvests():
    """Through propose/commit: the pool gains exactly the diagonals of the levels that ran,
    keyed by their first token, and the next step verifies the ones keyed by its root."""
    prop = LookaheadProposer(history=False)
    opts = LookaheadOptions(window_size=3, ngram_size=3, verification_set_size=2)
    tokens = [1, 2, 3, 4]
    for step in range(4):
        row = ProposalRow(slot=0, token_ids=tokens, num_tokens=2, options=opts)
        draft = prop.propose([row]).rows[0]
        window = copy.deepcopy(prop.window(0))
        best = [100 + 10 * step + k for k in range(len(draft.extra.tokens))]
        before = set(prop.pool(0).ngrams())
        prop.commit([CommitRow(0, [tokens[-1] + 1], [0], extra_best=best)])
        after = set(prop.pool(0).ngrams())
        if window.full:
            out = best[-3:]
            first = [tokens[-1]] + window.levels[0]
            assert after - before == {(first[j], (window.levels[1][j], out[j])) for j in range(3)} - before
        else:
            assert after == before
        tokens = tokens + [tokens[-1] + 1]
    key = prop.pool(0).ngrams()[0][0]  # a root with pooled continuations
    pooled = prop.pool(0).guess(key, 2)
    row = ProposalRow(slot=0, token_ids=tokens + [key], num_tokens=2, options=opts)
    draft = prop.propose([row]).rows[0]
    assert pooled and draft.tokens == pack_candidates(pooled, 2, 100)[0]


def test_pool_is_lru_per_key_and_bounded():
    pool = NgramPool(max_ngrams=6)
    for i in range(3):
        pool.add(1, (i, i), per_key=2)
    assert pool.guess(1, 5) == [(2, 2), (1, 1)] and len(pool) == 2
    pool.add(1, (1, 1), per_key=2)  # re-adding refreshes
    assert pool.guess(1, 5) == [(1, 1), (2, 2)]
    for key in range(2, 6):
        pool.add(key, (key, 0), per_key=2)
        pool.add(key, (key, 1), per_key=2)
    assert len(pool) <= 6 and pool.guess(1, 5) == []  # key 1 was the least recently used
    assert pool.guess(5, 5) == [(5, 1), (5, 0)]
    pool.add_sequence([7, 8, 9, 7, 8, 6], n=3, start=1, per_key=4)
    assert pool.guess(7, 4) == [(8, 6), (8, 9)] and len(pool) <= 6
    assert pack_candidates([(8, 6, 1), (8, 9, 2), (3,)], depth=2, budget=3) == ([8, 6, 9], [0, 1, 1])


def test_private_pools_are_freed_and_the_shared_pool_is_bounded(tiny_pair, references):
    prop = LookaheadProposer(shared_pool_ngrams=40)
    engine = engine_with(tiny_pair[0], 4, prop)
    prompts = ragged_prompts(8)
    specs = [lookahead(shared_pool=i % 2 == 0) for i in range(8)]
    private_pools, shared_sizes = {}, []
    for i, (p, s) in enumerate(zip(prompts, specs)):
        engine.add_request(p, GREEDY, s, request_id=str(i))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        pools = [prop.pool(slot) for slot in range(4)]
        private_pools.update({id(p): p for p in pools if p is not None and p is not prop.shared.get(3)})
        shared_sizes.append(len(prop.shared.get(3, ())))
    assert [done[str(i)] for i in range(8)] == references
    assert len(private_pools) == 4  # each request without shared_pool had its own ...
    assert all(prop.pool(slot) is None for slot in range(4))  # ... and finished requests' state is freed
    assert list(prop.shared) == [3] and max(shared_sizes) <= 40 and len(prop.shared[3]) > 0


def test_a_shared_pool_warms_up_on_repeated_traffic(tiny_pair):
    prompt = ragged_prompts(8)[5]
    for shared, warmer in ((False, False), (True, True)):
        engine = engine_with(tiny_pair[0], 1)
        first, second = (engine.generate([prompt], GREEDY, lookahead(shared_pool=shared))[0] for _ in range(2))
        assert first.token_ids == second.token_ids
        gained = second.metrics["num_accepted_tokens"] > first.metrics["num_accepted_tokens"]
        assert gained == warmer, (shared, first.metrics, second.metrics)


# -- sampling ------------------------------------------------------------------------------
def _lossy_tree_accept(tree, tokens, probs, generator, draft_probs=None):
    """A plausible bug: accept a one-hot candidate with probability p(x), but sample a
    rejection from p itself instead of the residual with x removed (biased toward x)."""
    node, path = 0, [0]
    while True:
        p = probs[node].double()
        nxt = next((c for c in tree.children[node] if torch.rand((), generator=generator, dtype=torch.float64)
                    < p[tokens[c]]), None)
        if nxt is None:
            final = int(torch.multinomial(p / p.sum(), 1, generator=generator))
            return TreeAcceptance(path, [tokens[n] for n in path[1:]] + [final])
        node = nxt
        path.append(node)


@pytest.fixture(scope="module")
def sampling_setup():
    from tests.test_sampling_e2e import exact_joint

    target = tiny_llama(vocab=8, seed=3, init=0.25)
    return target, exact_joint(target)


def _sample(target, spec):
    """N seeded requests of 4 tokens (test_sampling_e2e's prompt and parameters)."""
    from tests.test_sampling_e2e import N, PARAMS, PROMPT

    # 64 rows per step: lift the per-step budgets so every row verifies its whole tree and window.
    engine = engine_with(target, 64, LookaheadProposer(batch_window_tokens=10**6, batch_candidate_tokens=10**6))
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    outs = engine.generate([PROMPT] * N, params, spec)
    t = engine.totals
    # Candidates were verified in many steps, with acceptances and rejections.
    assert t.num_drafts > N // 2 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    if spec.ngram_size > 2:
        assert t.accepted_per_pos[1] > 0  # two-token candidates fully accepted too
    return np.array([o.token_ids for o in outs])


SAMPLED = [lookahead(4, 2, 4), lookahead(3, 3, 3, shared_pool=True)]  # a private pool, a shared one


@pytest.mark.parametrize("spec", SAMPLED, ids=["private", "shared"])
def test_sampling_keeps_the_target_distribution(sampling_setup, spec):
    from tests.test_sampling_e2e import check

    target, joint = sampling_setup
    pvals = check(_sample(target, spec), joint)
    assert min(pvals) > 1e-3, pvals


def test_the_sampling_check_catches_a_lossy_rule_on_lookahead_drafts(sampling_setup, monkeypatch):
    from tests.test_sampling_e2e import check

    target, joint = sampling_setup
    monkeypatch.setattr("specray.engine.accept.tree_rejection_accept", _lossy_tree_accept)
    assert min(check(_sample(target, SAMPLED[1]), joint)) < 1e-3


# -- entry points: coordinator (both layouts), batch jobs, CLI, HTTP -----------------------
ACTOR_SPECS = [{"method": "lookahead"}, {"method": "lookahead", "window_size": 3, "ngram_size": 4,
                                         "verification_set_size": 2, "shared_pool": True},
               {"method": "ngram"}, {"method": "lookahead", "window_size": 2, "ngram_size": 2}, {"method": "none"}]


def test_lookahead_through_the_coordinator(tiny_coordinator, tiny_pair):
    """The separate layout: the window and the pools live in a proposer worker of their own
    (colocated: test_colocated_tp2_every_method, the engine tests)."""
    import ray

    from tests.test_actors import GREEDY as ACTOR_GREEDY, PROMPTS

    c = tiny_coordinator
    outs = ray.get(c.generate.remote(PROMPTS, ACTOR_GREEDY, ACTOR_SPECS))
    refs = [hf_greedy(tiny_pair[0], p, ACTOR_GREEDY["max_tokens"]) for p in PROMPTS]
    assert [o["token_ids"] for o in outs] == refs
    assert all(o["metrics"]["num_drafts"] > 0 for o, s in zip(outs, ACTOR_SPECS) if s["method"] == "lookahead")
    workers = ray.get(c.workers.remote())
    state = ray.get(workers["lookahead"].__ray_call__.remote(
        lambda w: ([w.proposer.pool(s) for s in range(3)], {n: len(p) for n, p in w.proposer.shared.items()})))
    assert state[0] == [None] * 3 and state[1].get(4, 0) > 0  # private state freed; the shared pool kept
    with pytest.raises(ValueError, match="window_size"):
        ray.get(c.generate.remote([[1, 2]], ACTOR_GREEDY, {"method": "lookahead", "window_size": 1}))


def test_a_batch_job_refuses_bad_lookahead_lines(tiny_checkpoints, tmp_path, capsys, monkeypatch):
    """Every bad line named, before anything starts (lookahead's lines that run:
    tests/test_batch_methods.py)."""
    from specray.entrypoints import jobs

    config = tmp_path / "specray.yaml"
    config.write_text(f"target: {tiny_checkpoints['target']}\nmax_num_seqs: 3\n"
                      "default_speculation:\n  method: lookahead\nplacement:\n  mode: colocated\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [1], "speculation": {"method": "lookahead", "ngram_size": 1}}\n'
                   '{"prompt": [1], "speculation": {"method": "lookahead", "shared_pol": true}}\n')
    monkeypatch.setattr("specray.actors.coordinator.Coordinator", None)  # any use of it fails
    assert jobs.main(["--input", str(bad), "--output", str(tmp_path / "o2.jsonl"), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "line 1:" in err and "ngram_size" in err and "line 2:" in err and "shared_pol" in err


def test_cli_flags_come_from_the_options(capsys):
    from specray.entrypoints.cli import build_parser, main, request_speculation

    p, flags = build_parser()
    args = p.parse_args(["generate", "--prompt", "x", "--method", "lookahead", "--window-size", "6", "--ngram-size", "5",
                         "--verification-set-size", "3", "--shared-pool"])
    assert request_speculation(args, flags) == lookahead(6, 5, 3, shared_pool=True)
    args = p.parse_args(["generate", "--prompt", "x", "--method", "lookahead"])
    assert request_speculation(args, flags) == LookaheadOptions()  # the defaults
    assert main(["generate", "--prompt", "x", "--method", "lookahead", "--ngram-size", "1"]) == 2
    assert "--ngram-size 1" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_generate_with_lookahead_defaults_equals_plain(demo_pair, capsys):
    import json

    from specray.entrypoints.cli import main

    common = ["generate", "--prompt", "def add(a, b):\n    return a + b\n\n\ndef", "--max-tokens", "24", "--json"]
    assert main([*common, "--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "lookahead"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == plain["token_ids"] and out["metrics"]["num_drafts"] > 0


def test_lookahead_over_http(colocated_url, tiny_pair):
    import httpx
    import openai

    from tests.serving import COLOCATED, assert_openai_error

    client = openai.OpenAI(base_url=f"{colocated_url}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 1, 4]
    ref = decode(hf_greedy(tiny_pair[0], prompt, 20))
    for spec in ({"method": "lookahead"}, {"method": "lookahead", "window_size": 3, "ngram_size": 5,
                                           "verification_set_size": 2, "shared_pool": True}):
        r = client.completions.create(model=COLOCATED, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"speculation": spec})
        assert r.choices[0].text == ref, spec
        assert r.model_dump()["speculation_metrics"][0]["num_drafts"] > 0
    stream = client.completions.create(model=COLOCATED, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"speculation": {"method": "lookahead"}})
    assert "".join(ch.choices[0].text for ch in stream) == ref
    url = f"{colocated_url}/v1/completions"
    body = {"model": COLOCATED, "prompt": prompt, "max_tokens": 4, "speculation": {"method": "lookahead",
                                                                                  "window_size": 1}}
    assert_openai_error(httpx.post(url, json=body, timeout=60), 400, "window_size")
    body["speculation"] = {"method": "lookahead", "window_size": 16, "ngram_size": 4, "verification_set_size": 8}
    assert_openai_error(httpx.post(url, json=body, timeout=60), 400, "64-token context")


@pytest.mark.slow
def test_benchmark_smoke(demo_pair, tmp_path):
    import json

    from specray.bench import lookahead as bench

    threads = torch.get_num_threads()
    rc = bench.main(["--prompts", "2", "--max-tokens", "16", "--repeats", "1", "--batches", "1,2",
                     "--configs", "2:3:2,3:5:2:nohist,2:3:2:nowin", "--out", str(tmp_path)])
    assert rc == 0 and torch.get_num_threads() == threads
    for name in ("lookahead.csv", "lookahead.json", "lookahead.png", "lookahead.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "lookahead.json").read_text())
    runs = report["runs"]
    assert {r["config"] for r in runs} == {"plain", "ngram k=6", "lookahead 2:3:2", "lookahead 3:5:2 nohist",
                                           "lookahead 2:3:2 nowin"}
    assert all(r["mismatches_vs_plain"] == 0 and r["tokens_per_cpu_s"] > 0 and r["tokens_per_wall_s"] > 0 for r in runs)
    assert len(report["forward_cost"]) == 2 * len(bench.FORWARD_TOKENS)
