"""The fixed-shape step (``engine/graphs.py`` + ``engine/device_step.py``) against the eager
reference, on the CPU.

* Every method's greedy output through the static path equals HF ``generate`` (which the
  eager path equals), with ragged prompts, requests joining mid-run and an abort.
* A step reads the device back once: ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``,
  ``nonzero`` are counted inside steps that admit no request.
* Compiled: the same tokens, no recompiles over 100 steps of changing lengths, one compiled
  call a plain step (acceptance inside the target's graph), two a draft model's step at the
  default k (its chain of forwards in one graph), module numbers as constants.
* Sampling through the device acceptance keeps the target's distribution (chains with
  and without draft probabilities, trees with one-hot and drawn q).
"""

from __future__ import annotations

import copy
import types
import numpy as np
import pytest
import torch

from specray.bench.probes import host_reads
from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.policies.compiled import compiled, timing
from specray.policies.spec_length import SpeculationLengthPolicy
from tests.conftest import hf_greedy, tiny_llama
from tests.test_eagle import random_head
from tests.test_eagle3 import random_head3
from tests.test_engine import GREEDY, ragged_prompts
from tests.test_medusa import random_heads
from tests.test_redrafter import random_drafter
from tests.test_sampling_e2e import VOCAB as SMALL_VOCAB

SPECS = {
    "none": {},
    "draft": {"num_speculative_tokens": 3},
    "ngram": {"num_speculative_tokens": 3},
    "medusa": {},
    "eagle": {},
    "eagle-2": {"dynamic_tree": True, "top_k": 4, "depth": 4, "total_tokens": 12},
    "eagle3": {},
    "eagle3-2": {"dynamic_tree": True, "top_k": 4, "depth": 4, "total_tokens": 12},
    "redrafter": {},
    "lookahead": {"window_size": 3, "ngram_size": 3, "verification_set_size": 3},
    "suffix": {},
}


def engine_for(models, step: str, max_num_seqs: int = 4, **kw) -> LLMEngine:
    target, draft = models
    return LLMEngine(
        # Static speculation lengths: every row drafts, whatever this machine's timings.
        EngineConfig(target="x", max_num_seqs=max_num_seqs, step=step,
                     speculation_length=SpeculationLengthPolicy(), **kw),
        target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft),
        medusa_heads=random_heads(),
        resources={"eagle": random_head(target), "eagle3": random_head3(target), "redrafter": random_drafter()},
    )


def speculation(name: str) -> SpeculationParams:
    return SpeculationParams(method=name.split("-")[0], **SPECS[name])


@pytest.mark.parametrize("name", list(SPECS))
def test_static_step_equals_hf_for_every_method(tiny_pair, references, name):
    engine = engine_for(tiny_pair, "static")
    outs = engine.generate(ragged_prompts(8), GREEDY, speculation(name))  # 8 prompts, 4 slots: joins
    assert [o.token_ids for o in outs] == references
    if name != "none":
        assert engine.totals.num_drafts > 0


def test_static_step_mixed_methods_and_abort(tiny_pair, references):
    engine = engine_for(tiny_pair, "static")
    names = list(SPECS)
    ids = [engine.add_request(p, GREEDY, speculation(names[i % len(names)])) for i, p in enumerate(ragged_prompts(8))]
    done, aborted = {}, ids[5]
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        steps += 1
        if steps == 3:
            engine.abort(aborted)
    for i, rid in enumerate(ids):
        if rid != aborted:
            assert done[rid] == references[i], names[i % len(names)]


def reads_per_step(engine: LLMEngine) -> list[int]:
    """Host reads in each step after the first (which admits everyone: prefill reads the
    first tokens), until every request finishes."""
    engine.step()
    reads = []
    while engine.has_unfinished():
        with host_reads() as counts:
            engine.step()
        reads.append(counts["reads"])
    return reads


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(SPECS))
def test_one_host_read_per_step(tiny_pair, name, temperature):
    """Every method drafts on the device (EAGLE-2's trees and ReDrafter's beams included,
    sampled EAGLE rows drawn there), so every step reads the device once: greedy and
    sampled, a batch of 8 and a batch of 1."""
    for batch in (8, 1):
        engine = engine_for(tiny_pair, "static", max_num_seqs=batch)
        for i, p in enumerate(ragged_prompts(batch)):
            params = SamplingParams(max_tokens=12, temperature=temperature, top_k=20, seed=i, ignore_eos=True)
            engine.add_request(p, params, speculation(name))
        reads = reads_per_step(engine)
        assert len(reads) >= 3 and max(reads) == 1, (batch, reads)
        if name not in ("none", "lookahead"):  # lookahead's pool may not match these short runs
            assert engine.totals.num_drafts > 0


EXPLICIT_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
GAPPED_TREE = [[2], [0], [0, 3], [2, 1], [6]]  # ranks skipped, as trees fitted to a head's accuracy may


@pytest.mark.parametrize("method, spec, cap", [
    ("eagle", {}, None), ("eagle", {"tree": "chain"}, None), ("eagle", {"eagle_choices": EXPLICIT_TREE}, None),
    ("eagle3", {}, None), ("eagle3", {"tree": "chain"}, None),
    ("eagle", {"dynamic_tree": True, "top_k": 4, "depth": 4, "total_tokens": 12}, None),
    ("eagle", {"dynamic_tree": True, "top_k": 3, "depth": 6, "total_tokens": 40}, None),
    ("eagle3", {"dynamic_tree": True, "top_k": 4, "depth": 4, "total_tokens": 12}, None),
    ("eagle", {"eagle_choices": EXPLICIT_TREE}, 3), ("eagle3", {}, 2),
    ("eagle", {"dynamic_tree": True, "top_k": 4, "depth": 4, "total_tokens": 12}, 3),
    ("eagle3", {"eagle_choices": GAPPED_TREE}, None),
], ids=["eagle default tree", "eagle chain", "eagle explicit", "eagle3 default tree", "eagle3 chain",
        "eagle-2", "eagle-2 deep", "eagle3 dynamic", "eagle explicit capped", "eagle3 tree capped", "eagle-2 capped",
        "eagle3 gapped tree"])
def test_eagle_trees_drafted_on_the_device_equal_the_hosts(tiny_pair, references, method, spec, cap):
    """Trees grown on the device (static, and EAGLE-2's dynamic ones) draft the tokens the
    host path drafts: every request accepts the same number of tokens at every position,
    under eager (host drafting) and the static step (device drafting, one read per step).
    Losslessness alone would not show it. Under a cap (the self-tuning length's), both keep
    the tree's best-scored nodes."""
    from tests.test_eagle import self_head
    from tests.test_eagle3 import random_head3

    target, _ = tiny_pair
    head = {"eagle": self_head(target), "eagle3": random_head3(target)}[method]
    runs = []
    for step in ("eager", "static"):
        policy = SpeculationLengthPolicy(batch_k_caps=((1, cap),) if cap else ())
        engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4, step=step, speculation_length=policy),
                           target_model=copy.deepcopy(target), resources={method: copy.deepcopy(head)})
        outs = engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method=method, **spec))
        assert [o.token_ids for o in outs] == references
        runs.append([(o.metrics["num_drafts"], o.metrics["accepted_per_pos"]) for o in outs])
    assert runs[0] == runs[1]
    assert sum(n for n, _ in runs[0]) > 0


# -- the compiled step ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_pair():
    """(target, draft) over the chi-square tests' 8-token vocabulary (tests/test_sampling_e2e.py)."""
    return tiny_llama(vocab=SMALL_VOCAB, seed=3, init=0.25), tiny_llama(vocab=SMALL_VOCAB, layers=1, seed=4, init=0.25)


def small_engine(small_pair, step: str) -> LLMEngine:
    """64 rows (the chi-square tests sample thousands at once), every method's weights loaded."""
    target, draft = small_pair
    return LLMEngine(
        EngineConfig(target="x", max_num_seqs=64, step=step, speculation_length=SpeculationLengthPolicy()),
        target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft),
        medusa_heads=random_heads(vocab=SMALL_VOCAB),
        resources={"eagle": random_head(target), "eagle3": random_head3(target, draft_vocab=6),
                   "redrafter": random_drafter(vocab=SMALL_VOCAB)})


@pytest.fixture(scope="module")
def small_references(small_pair):
    """HF greedy continuations of the small target for ``ragged_prompts(8)`` in its vocabulary."""
    return [hf_greedy(small_pair[0], p, GREEDY.max_tokens) for p in ragged_prompts(8, vocab=SMALL_VOCAB)]


@pytest.fixture(scope="module")
def compiled_engine(small_pair):
    """(the compiled engine over the small pair, the graphs its warm-up compiled): compiling is
    the cost, so the compiled-step test and the compiled chi-square tests share it. Dynamo
    starts empty here, so its counters count this engine's graphs (the one test that resets
    dynamo runs before the first user)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine = small_engine(small_pair, "compile")
    return engine, counters["stats"]["unique_graphs"]


def test_compiled_graphs_take_module_numbers_as_constants(monkeypatch):
    """A float or int a module holds (an RMSNorm's eps, a cache's capacity) is a constant of
    the compiled graph, not an input rebuilt as a tensor on every call (torch's default for
    the numbers it reads under dynamic shapes); tensor sizes stay symbolic."""
    import torch._dynamo

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=capture, dynamic=True, fullgraph=True))
    norm = torch.nn.Module()
    norm.eps, norm.weight = 1e-5, torch.nn.Parameter(torch.ones(4))
    cache = types.SimpleNamespace(shift=3)  # not a module: its ints were symbolic

    def rms(x):
        return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) + cache.shift

    torch._dynamo.reset()
    fn = compiled(rms, "cpu")
    for n in (3, 5):  # a new batch size: no recompile
        x = torch.randn(n, 4)
        assert torch.allclose(fn(x), rms(x))
    (gm,) = graphs
    inputs = {n.name: n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"}
    assert not [name for name in inputs if "eps" in name or "shift" in name], inputs
    assert any(isinstance(v, torch.SymInt) for v in inputs.values()), inputs  # the batch stays dynamic


def test_compiled_step_equals_eager_without_recompiles(compiled_engine, small_pair, small_references):
    """torch.compile with dynamic shapes: one graph per model for every batch size and width
    (dynamo specializes only sizes 0 and 1, which the static path pads away) — the target's,
    the draft model's, the acceptance's and each head's (EAGLE, EAGLE-3, Medusa, ReDrafter's
    beam level) — none recompiled as batches, widths, trees and lengths change step after
    step; every method's greedy output equals HF's (batches of 8 down to 1)."""
    from torch._dynamo.utils import counters

    engine, warm_graphs = compiled_engine
    # target, draft (its chain of forwards, greedy and with sampled rows, and its one forward
    # for a longer k: warm-up drafts all three), acceptance, EAGLE, EAGLE-3, Medusa, ReDrafter
    assert warm_graphs == 9
    graphs, recompiles = counters["stats"]["unique_graphs"], dict(counters["recompiles"])

    def no_new_graphs():
        assert counters["stats"]["unique_graphs"] == graphs and dict(counters["recompiles"]) == recompiles, \
            (dict(counters["stats"]), dict(counters["recompiles"]))

    prompts = ragged_prompts(8, vocab=SMALL_VOCAB)
    references = small_references
    names = list(SPECS)
    for start in range(0, len(names), 4):  # 8 requests at once, mixed methods: batches of 8 down to 1
        first = engine.generate(prompts, GREEDY, [speculation(names[(start + i) % len(names)]) for i in range(8)])
        assert [o.token_ids for o in first] == references, names[start : start + 4]
    no_new_graphs()
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    mixed = [speculation(n) for n in ("none", "eagle-2", "redrafter")]
    outs = engine.generate(prompts[:3], long, mixed)  # 100 steps, lengths change each
    no_new_graphs()
    eager = small_engine(small_pair, "eager").generate(prompts[:3], long, mixed)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    # One compiled call a plain step: acceptance runs inside the target's graph (its epilogue);
    # rows whose logits are processed (a penalty) accept in the acceptance's own graph.
    for sampling, calls in ((long, 1), (SamplingParams(max_tokens=100, temperature=0, ignore_eos=True,
                                                       repetition_penalty=1.2), 2)):
        rid = engine.add_request(prompts[0], sampling, SpeculationParams(method="none"))
        engine.step()  # the prefill (eager)
        with timing() as clock:
            for _ in range(5):
                engine.step()
        engine.abort(rid)
        assert clock.calls == 5 * calls, (sampling, clock.calls)
    no_new_graphs()
    # Draft rows draft in one compiled call (the draft's forwards and draws in one graph,
    # ``StaticForward.chain``, compiled at warm-up for the default k; shorter k, such as the 3
    # above, keep its first tokens): the draft's and the target's, two a step, greedy or
    # sampled. A longer k drafts a forward at a time. Batches of 1 to 4, no graph more.
    default_k = SpeculationParams(method="draft")
    longer = SpeculationParams(method="draft", num_speculative_tokens=default_k.num_speculative_tokens + 1)
    outs = engine.generate(prompts, GREEDY, longer)
    assert [o.token_ids for o in outs] == references
    no_new_graphs()
    sampled = SamplingParams(max_tokens=100, temperature=0.8, seed=0, ignore_eos=True)
    one = SpeculationParams(method="draft", num_speculative_tokens=1)  # one forward: no chain
    for spec, sampling, calls in ((default_k, long, 2), (speculation("draft"), long, 2), (default_k, sampled, 2),
                                  (longer, long, 2 + default_k.num_speculative_tokens), (one, long, 2)):
        rid = engine.add_request(prompts[0], sampling, spec)
        engine.step()
        with timing() as clock:
            for _ in range(5):
                engine.step()
        engine.abort(rid)
        assert clock.calls == 5 * calls, (spec, sampling, clock.calls)
    no_new_graphs()
    # Sampled rows that fill their batch bucket (8: the chain's sampling inputs go in unpadded,
    # where warm-up's one row's are padded) draft through warm-up's chain graph too.
    engine.generate(prompts, [SamplingParams(max_tokens=4, temperature=0.8, seed=i, ignore_eos=True) for i in range(8)],
                    default_k)
    no_new_graphs()


# -- sampling through the device acceptance --------------------------------------------------
@pytest.fixture(scope="module")
def sampling_engine(request, small_pair):
    """The engine of a step mode for the chi-square tests: the static one built here, once for
    its methods; the compiled one is the compiled-step test's."""
    engines = {}

    def get(step: str) -> LLMEngine:
        if step == "compile":
            return request.getfixturevalue("compiled_engine")[0]
        if step not in engines:
            engines[step] = small_engine(small_pair, step)
        return engines[step]

    return get


@pytest.mark.parametrize("step, name", [
    ("static", "draft"), ("static", "ngram"), ("static", "medusa"), ("static", "eagle"), ("static", "eagle-2"),
    ("static", "eagle3"), ("static", "redrafter"), ("compile", "draft"), ("compile", "eagle"),
    ("compile", "redrafter"),
])
def test_device_sampling_matches_target_distribution(sampling_engine, small_pair, step, name):
    """Sampled rows through the device step keep the target's distribution: chains with and
    without draft probabilities, static trees with drawn q (EAGLE's, drawn on the device),
    dynamic trees and packed beams built on the device (one-hot q)."""
    from specray.engine.metrics import SpecMetrics
    from tests import test_sampling_e2e as E

    target = small_pair[0]
    engine = sampling_engine(step)
    engine.scheduler.totals = SpecMetrics()
    params = [SamplingParams(seed=i, **E.PARAMS) for i in range(E.N)]
    options = {"draft": {"num_speculative_tokens": 3}, "ngram": {"num_speculative_tokens": 3},
               "eagle-2": {"dynamic_tree": True, "top_k": 3, "depth": 3, "total_tokens": 8},
               "redrafter": {"num_beams": 3, "draft_len_per_beam": 3}}.get(name, {})
    outs = engine.generate([E.PROMPT] * E.N, params, SpeculationParams(method=name.split("-")[0], **options))
    t = engine.totals
    assert t.num_drafts > E.N // 2 and 0 < t.num_accepted_tokens < t.num_draft_tokens
    seqs = np.array([o.token_ids for o in outs])
    pvals = E.check(seqs, E.exact_joint(target))
    assert min(pvals) > 1e-3, pvals


@pytest.mark.slow  # minutes of C++ compilation, in compile worker processes
def test_inductor_kernels_keep_greedy_output_and_the_sampling_distribution(inductor, small_pair):
    """The other compile tests capture with aot_eager; here inductor generates and runs the
    kernels (C++ on a CPU) of the target, the draft's chain and the acceptance: greedy output
    equals the eager step's (itself HF's: the tests above), and sampled rows keep the target's distribution (inductor's
    own random numbers)."""
    from tests import test_sampling_e2e as E

    target, draft = small_pair
    engines = [LLMEngine(EngineConfig(target="x", max_num_seqs=64, step=step,
                                      speculation_length=SpeculationLengthPolicy()),
                         target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft))
               for step in ("compile", "eager")]
    prompts = ragged_prompts(8, vocab=E.VOCAB)
    for name in ("none", "draft"):
        compiled_outs, eager_outs = (e.generate(prompts, GREEDY, speculation(name)) for e in engines)
        assert [o.token_ids for o in compiled_outs] == [o.token_ids for o in eager_outs], name
    engine = engines[0]
    outs = engine.generate([E.PROMPT] * E.N, [SamplingParams(seed=i, **E.PARAMS) for i in range(E.N)],
                           SpeculationParams(method="draft", num_speculative_tokens=3))
    assert 0 < engine.totals.num_accepted_tokens < engine.totals.num_draft_tokens
    pvals = E.check(np.array([o.token_ids for o in outs]), E.exact_joint(target))
    assert min(pvals) > 1e-3, pvals
