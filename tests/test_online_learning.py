"""Online learning in one process: capture, the bounded buffer, and drafter versions swapped
between steps (greedy output identical, sampling distribution-exact, state rebuilt)."""

import copy

import numpy as np
import pytest
import torch

from specray.engine.capture import CaptureConfig, Trace, TraceBuffer
from specray.engine.config import EngineConfig
from specray.engine.drafter_versions import DrafterVersion, snapshot, weights_module, write_version
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from tests.conftest import tiny_llama
from tests.test_eagle import random_head, self_head
from tests.test_eagle3 import random_head3
from tests.test_medusa import random_heads
from tests.test_redrafter import random_drafter
from tests.test_engine import GREEDY, ragged_prompts

ONLINE = CaptureConfig(top_k=4, min_tokens=2)


def online_engine(target, draft=None, head=None, max_num_seqs=4, heads=None, **kw):
    """heads: other methods' resources (EAGLE-3, Medusa, ReDrafter), by method."""
    resources = {"eagle": copy.deepcopy(head)} if head is not None else {}
    resources.update({m: copy.deepcopy(h) for m, h in (heads or {}).items()})
    kw.setdefault("profile_costs", False)  # (the budget drafts from the first steps: captures and swaps are exercised)
    return LLMEngine(EngineConfig(target="x", max_num_seqs=max_num_seqs, online_learning=ONLINE, **kw),
                     target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft) if draft is not None else None,
                     resources=resources)


def perturbed(method: str, state: dict, seed: int, scale: float = 0.5) -> DrafterVersion:
    """Another version: every weight moved (some are much worse drafters, some better)."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v + scale * v.std().nan_to_num() * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
           for k, v in state.items()}
    return DrafterVersion(method, f"{method}@test{seed}", new, {"rates": [0.5, 0.3]})


def run_with_swaps(engine, prompts, sampling, spec, method, every=2):
    """Generate, swapping in a new version of ``method`` every ``every`` steps."""
    base = snapshot(engine.proposers.resources[method])
    ids = [engine.add_request(p, s, spec) for p, s in zip(prompts, sampling)]
    done, steps, swaps = {}, 0, 0
    while len(done) < len(ids):
        if steps and steps % every == 0 and engine.scheduler.running:
            swaps += 1
            engine.use_drafter(perturbed(method, base, swaps, scale=0.3 * (swaps % 3)))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    return [done[i] for i in ids], swaps


@pytest.fixture(scope="module")
def models():
    return tiny_llama(layers=2, seed=0), tiny_llama(layers=1, seed=1)


@pytest.fixture(scope="module")
def other_heads(models):
    """Random EAGLE-3, Medusa and ReDrafter heads over the tiny target (the trainers' other recipes)."""
    target, _ = models
    return {"eagle3": random_head3(target, seed=3, std=0.1), "medusa": random_heads(seed=3),
            "redrafter": random_drafter(seed=3, std=0.1)}


@pytest.fixture(scope="module")
def references(models):
    target, _ = models
    engine = LLMEngine(EngineConfig(target="x", max_num_seqs=4), target_model=copy.deepcopy(target))
    return [o.token_ids for o in engine.generate(ragged_prompts(6), GREEDY, SpeculationParams(method="none"))]


@pytest.mark.parametrize("method,spec,step", [
    ("draft", {"num_speculative_tokens": 3}, "eager"),
    ("draft", {"num_speculative_tokens": 3}, "static"),
    ("draft", {}, "eager"),  # the self-tuning length, restarted from each version's rates
    ("eagle", {"tree": "chain"}, "eager"),
    ("eagle", {"dynamic_tree": True, "top_k": 3, "depth": 3, "total_tokens": 8}, "eager"),
    # random heads, drafting every step (an explicit tree or beam shape: no self-tuning length)
    ("eagle3", {"tree": "chain"}, "eager"),
    ("medusa", {"tree": "chain"}, "eager"),
    ("redrafter", {"num_beams": 2, "draft_len_per_beam": 2}, "eager"),
])
def test_greedy_output_is_the_targets_through_swaps(models, other_heads, references, method, spec, step):
    target, _ = models
    # versions: the target moved, or not
    engine = online_engine(target, target, self_head(target), heads=other_heads, step=step)
    weights = {n: p.data_ptr() for n, p in weights_module(engine.proposers.resources[method]).state_dict().items()}
    outs, swaps = run_with_swaps(engine, ragged_prompts(6), [GREEDY] * 6, SpeculationParams(method=method, **spec),
                                 method)
    assert swaps >= 3
    assert [o.token_ids for o in outs] == references
    assert engine.totals.num_accepted_tokens > 0
    # copied in place: the serving tensors are the same objects (a compiled step keeps reading them)
    after = {n: p.data_ptr() for n, p in weights_module(engine.proposers.resources[method]).state_dict().items()}
    assert after == weights
    # every request's steps are counted under the versions that drafted them
    by_version = engine.totals.accepted_by_version
    assert sum(d for d, _ in by_version.values()) == engine.totals.num_drafts
    # (without a length the budget may price a version off: its saved rates here, 0.5 and 0.3, for a
    # drafter as costly as the target)
    assert len(by_version) >= (2 if spec else 1)


def test_a_swap_rebuilds_the_heads_state_from_the_kept_features(models):
    """After a swap, each running request's EAGLE head cache equals the new head run over the
    committed pairs built from the target's true features: as if it had served from the start."""
    target, _ = models
    new = self_head(target)
    engine = online_engine(target, head=random_head(target, seed=1, std=0.2), max_num_seqs=2)
    ids = [engine.add_request(p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                              SpeculationParams(method="eagle", tree="chain")) for p in ragged_prompts(2)]
    for _ in range(3):
        engine.step()
    engine.use_drafter(DrafterVersion("eagle", "eagle@new", snapshot(new)))
    engine.step()
    proposer = engine.proposers.get("eagle")
    runner = proposer.runner
    for rid in ids:
        req = engine.scheduler.find(rid)
        n = runner.lengths[req.slot]
        assert n > len(req.prompt_ids)
        seq = req.token_ids
        with torch.no_grad():
            feats = target.model(torch.tensor([seq[:n]])).last_hidden_state[0]
            fresh = copy.deepcopy(runner)
            fresh.reset(req.slot)
            fresh.forward([req.slot], [seq[1 : n + 1]], embeds=[proposer.head.fuse_target(torch.tensor(seq[1 : n + 1]), feats)])
        for layer in range(runner.num_layers):
            torch.testing.assert_close(runner.cache.keys[layer][req.slot, :, :n],
                                       fresh.cache.keys[layer][req.slot, :, :n], atol=1e-5, rtol=0)


def test_sampled_output_keeps_the_target_distribution_through_swaps(models):
    from tests.test_sampling_e2e import N, PARAMS, PROMPT, VOCAB, check, exact_joint

    target, draft = tiny_llama(vocab=VOCAB, seed=3, init=0.25), tiny_llama(vocab=VOCAB, layers=1, seed=4, init=0.25)
    engine = online_engine(target, draft, max_num_seqs=64)
    params = [SamplingParams(seed=i, **PARAMS) for i in range(N)]
    outs, swaps = run_with_swaps(engine, [PROMPT] * N, params, SpeculationParams(method="draft", num_speculative_tokens=3),
                                 "draft", every=1)
    assert swaps >= 3 and len(engine.totals.accepted_by_version) >= 3
    seqs = np.array([o.token_ids for o in outs])
    assert min(check(seqs, exact_joint(target))) > 1e-3


def test_capture_records_what_the_recipes_read(models):
    """Greedy requests: the teacher's top token at each verified position is the emitted token;
    the captured features give the target's next token through its LM head."""
    target, draft = models
    engine = online_engine(target, draft, self_head(target))
    prompts = ragged_prompts(4)
    outs = engine.generate(prompts, GREEDY, [SpeculationParams(method="draft", num_speculative_tokens=3)] * 2
                           + [SpeculationParams(method="eagle", tree="chain")] * 2)
    traces = {}
    for t in engine.take_traces():
        traces.setdefault(t.method, []).append(t)
    assert len(traces["draft"]) == 2 and len(traces["eagle"]) == 2
    by_tokens = {tuple(p + o.token_ids): o for p, o in zip(prompts, outs)}
    for t in traces["draft"]:
        assert tuple(t.tokens) in by_tokens and t.features is None
        assert t.topk_ids.shape == (len(t.tokens) - t.prompt_len, 4)
        assert t.topk_ids[:, 0].tolist() == t.tokens[t.prompt_len:]
        assert torch.all(t.topk_logprobs[:, :-1] >= t.topk_logprobs[:, 1:]) and torch.all(t.topk_logprobs <= 0)
    for t in traces["eagle"]:
        assert tuple(t.tokens) in by_tokens and t.topk_ids is None
        assert t.features.shape == (len(t.tokens) - 1, target.config.hidden_size)
        nxt = (t.features @ target.lm_head.weight.T).argmax(-1)
        assert nxt[t.prompt_len - 1:].tolist() == t.tokens[t.prompt_len:]
    assert engine.take_traces() == []


def test_capture_samples_and_switches_off(models):
    target, draft = models
    engine = online_engine(target, draft)
    engine.capture.config = CaptureConfig(sample_rate=0.5, min_tokens=2)
    engine.generate(ragged_prompts(8), GREEDY, SpeculationParams(method="draft", num_speculative_tokens=2))
    assert 0 < len(engine.take_traces()) < 8
    engine.capture.enabled = False
    engine.generate(ragged_prompts(4), GREEDY, SpeculationParams(method="draft", num_speculative_tokens=2))
    assert engine.take_traces() == []


def test_the_buffer_never_exceeds_its_cap():
    g = torch.Generator().manual_seed(0)
    buf = TraceBuffer(max_bytes=20_000)
    sizes = []
    for i in range(200):
        n = int(torch.randint(4, 60, (1,), generator=g))
        t = Trace("eagle", list(range(n + 4)), 4, features=torch.zeros(n + 3, 16))
        buf.add([t])
        sizes.append(t.nbytes)
        assert buf.nbytes <= 20_000 and buf.nbytes == sum(x.nbytes for x in buf.traces())
    assert buf.added + buf.dropped >= 200 and buf.dropped > 0
    kept = buf.traces()
    assert kept[-1].tokens == list(range(n + 4))  # the newest are kept
    buf.add([Trace("eagle", [0] * 10, 4, features=torch.zeros(10_000, 16))])  # too big to ever fit
    assert buf.nbytes <= 20_000


def test_load_and_export_in_the_public_layout(models, tmp_path):
    target, draft = models
    engine = online_engine(target, draft, self_head(target))
    for method in ("draft", "eagle"):
        v = perturbed(method, snapshot(engine.proposers.resources[method]), 7)
        out = write_version(v, engine.proposers.resources[method], str(tmp_path / method))
        name = engine.load_drafter(method, out)
        assert name == f"{method}@{method}" and engine.versions.serving[method] == name
        served = snapshot(engine.proposers.resources[method])
        for k, t in v.state.items():
            torch.testing.assert_close(served[k], t)
    with pytest.raises(ValueError, match="no such directory"):
        engine.load_drafter("draft", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="learnable"):
        engine.use_drafter(DrafterVersion("ngram", "x", {}))


@pytest.mark.parametrize("method,options", [("draft", {"num_speculative_tokens": 3}), ("eagle", {"tree": "chain"}),
                                            ("eagle", {"eagle_choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}),
                                            ("eagle3", {"tree": "chain"}), ("medusa", {"tree": "chain"}),
                                            ("redrafter", {"num_beams": 2, "draft_len_per_beam": 2})])
def test_the_gate_measures_what_the_engine_measured(models, other_heads, method, options):
    """Replaying greedy traffic with the serving drafter gives the engine's own mean accepted
    length (and draft count) on it, exactly."""
    from specray.training.online import measure

    target, draft = models
    engine = online_engine(target, draft, random_head(target, seed=2, std=0.1), heads=other_heads)
    outs = engine.generate(ragged_prompts(6), GREEDY, SpeculationParams(method=method, **options))
    drafts = sum(o.metrics["num_drafts"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    bp = engine.versions.blueprint(method)
    got = measure(bp, bp.module, engine.take_traces(), options)
    assert got["drafts"] == drafts > 0
    assert got["mean_accepted_length"] == pytest.approx(1 + accepted / drafts)


def test_a_round_publishes_only_what_beats_the_serving_version(models):
    """The draft learns the target's greedy traffic and is published; a candidate forced worse
    (every weight scrambled) is judged by the same gate and not published."""
    from tests import online_trainers as T

    target, draft = models
    engine = online_engine(target, draft)
    engine.generate(ragged_prompts(16, seed=1), GREEDY, SpeculationParams(method="draft", num_speculative_tokens=3))
    traces, bp = engine.take_traces(), engine.versions.blueprint("draft")
    good = T.fast(bp, None, traces, {"gate_options": {"num_speculative_tokens": 3}})
    assert good.published and good.state is not None
    assert good.candidate["mean_accepted_length"] > good.serving["mean_accepted_length"]
    serving = DrafterVersion("draft", "draft@1", good.state)
    bad = T.worse(bp, serving, traces, {"gate_options": {"num_speculative_tokens": 3}})
    assert not bad.published and bad.state is None
    assert bad.candidate["mean_accepted_length"] < bad.serving["mean_accepted_length"]
    assert bad.serving["mean_accepted_length"] == good.candidate["mean_accepted_length"]


@pytest.mark.parametrize("method,options,steps,lr", [("eagle3", {"tree": "chain"}, 12, 3e-2),
                                                     ("medusa", {"tree": "chain"}, 40, 1e-2),
                                                     ("redrafter", {"num_beams": 2, "draft_len_per_beam": 2}, 40, 1e-2)])
def test_each_heads_recipe_learns_from_captured_traffic(models, other_heads, method, options, steps, lr):
    """EAGLE-3 (its training-time test, labelled by the captured top-k), Medusa and ReDrafter
    (cross-entropy on the target's tokens after each captured feature) fine-tune a random head
    on traffic that recurs (each prompt served twice) into one the gate publishes; the published
    state is the head's own keys, and it serves. Medusa's and ReDrafter's repeats start from
    cached prefixes (paged KV): their traces begin where the target computed features."""
    from specray.training.online import train_round

    target, _ = models
    engine = online_engine(target, heads={method: other_heads[method]})
    engine.generate(ragged_prompts(8, seed=1) * 2, GREEDY, SpeculationParams(method=method, **options))
    traces, bp = engine.take_traces(), engine.versions.blueprint(method)
    assert len(traces) == 16 and all(t.features.shape[0] == len(t.tokens) - 1 for t in traces)
    assert all((t.topk_ids is not None) == (method == "eagle3") for t in traces)  # EAGLE-3's labels: the teacher
    assert (engine.stats()["kv"]["prefix_hits"] > 0) == (method != "eagle3")  # EAGLE-3's rebuilt KV: no reuse
    got = train_round(bp, None, traces, {"steps": steps, "lr": lr, "batch_size": 4, "min_holdout": 4,
                                         "gate_options": options})
    assert got.published and got.candidate["mean_accepted_length"] > got.serving["mean_accepted_length"]
    assert got.state.keys() == weights_module(bp.module).state_dict().keys()
    engine.use_drafter(DrafterVersion(method, f"{method}@1", got.state))  # and it serves
    assert engine.versions.serving[method] == f"{method}@1"


def test_the_teacher_is_the_targets_top_k_at_the_requests_temperature():
    """OSD's teacher: the top-k renormalised at the temperature the request drew at; greedy
    requests (0) get ``greedy_temperature`` (a sharpened soft label), or the one-hot at 0."""
    from specray.training.draft_distill import TeacherSet, teacher, teacher_temperature
    from specray.training.online import RoundConfig, _teachers

    top_lp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5], [0.3, 0.2, -1.0]]), dim=-1)  # [2, k=3]
    for temp in (0.5, 1.0, 2.0):
        want = torch.softmax(top_lp / temp, dim=-1)
        torch.testing.assert_close(teacher(top_lp, torch.full((2,), temp)), want)
    torch.testing.assert_close(teacher(top_lp, torch.zeros(2)), torch.tensor([[1.0, 0, 0], [1.0, 0, 0]]))
    assert teacher_temperature(0.0, 0.25) == 0.25 and teacher_temperature(0.7, 0.25) == 0.7
    traces = [Trace("draft", [1, 2, 3, 4], 2, topk_ids=torch.tensor([[3, 5], [4, 6]]), topk_logprobs=top_lp[:, :2],
                    temperature=t) for t in (0.0, 0.8)]
    data = _teachers(traces, RoundConfig(greedy_temperature=0.3))
    assert data.temperature.tolist() == pytest.approx([0.3, 0.8])
    assert data.valid[0].tolist() == [False, True, True, False] and data.top_ids[0, 1].tolist() == [3, 5]
    assert isinstance(data, TeacherSet)


def test_the_loss_reads_the_logits_of_the_whole_model_at_its_positions():
    """``logits_where`` (the LM head only where OSD's loss reads) equals the model's own logits
    at those positions, soft-capped as the model caps them, gradients included."""
    from specray.training.draft_distill import logits_where

    model = tiny_llama(layers=1, seed=3)
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    where = torch.rand(3, 9, generator=torch.Generator().manual_seed(1)) > 0.5
    for cap in (None, 5.0):
        model.config.final_logit_softcapping = cap
        full = model(input_ids=ids).logits
        if cap:
            full = torch.tanh(full / cap) * cap
        torch.testing.assert_close(logits_where(model, ids, where), full[where].float())
    logits_where(model, ids, where).sum().backward()
    assert model.get_output_embeddings().weight.grad is not None


def test_the_switch_and_the_section_reach_the_engine_config():
    from specray.serve.config import ServeConfig

    assert ServeConfig.model_validate({}).engine.engine_config().online_learning is None
    cfg = ServeConfig.model_validate({"online-learning": True, "engine": {"target": "t"}}).engine
    assert cfg.online_learning.enabled and cfg.engine_config().online_learning.top_k == 20
    cfg = ServeConfig.model_validate({"engine": {"online_learning": {"enabled": True, "sample_rate": 0.25,
                                                                     "methods": ["eagle"]}}}).engine
    assert cfg.engine_config().online_learning == CaptureConfig(("eagle",), 0.25, 20)
    with pytest.raises(ValueError, match="top_k"):
        ServeConfig.model_validate({"engine": {"online_learning": {"top_k": 64}}})


def test_a_new_version_restarts_the_budgets_acceptance(models):
    """The verification budget forgets the old version's acceptance and starts from the new one's
    measured rates (per draft position): a new row's slot values come from them."""
    from specray.policies.budget import RowView

    target, draft = models
    engine = online_engine(target, draft)
    engine.generate(ragged_prompts(2), GREEDY, SpeculationParams(method="draft"))
    policy = engine.driver.length_policy
    assert policy.values(RowView("a new request", "draft"), 2) != pytest.approx([0.9, 0.45])
    engine.use_drafter(DrafterVersion("draft", "draft@x", snapshot(engine.proposers.resources["draft"]),
                                      {"rates": [0.9, 0.5]}))
    # The old version's counts are gone; the new rates are where the estimates start, as a
    # trained head's saved acceptance is: beyond the measured positions, the last one's rate.
    assert policy.priors["draft"] == [0.9, 0.5]
    assert policy.values(RowView("a new request", "draft"), 4) == pytest.approx([0.9, 0.45, 0.225, 0.1125])


@pytest.mark.slow
def test_the_benchmark_runs(tmp_path):
    import json

    from specray.bench import online

    rc = online.main(["--methods", "draft", "--requests", "20", "--wave", "10", "--window", "10", "--round-requests",
                      "10", "--steps", "3", "--max-tokens", "12", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "online.json").read_text())["methods"]["draft"]
    assert rc == 0 and report["identical_tokens"] and (tmp_path / "online.png").exists()
    assert len(report["rounds"]) == 2 and len(report["curve_on"]) == len(report["curve_off"]) == 2


def test_the_hub_says_where_the_trainer_waits_and_each_rounds_decision():
    from specray.actors.learner import LearnerCore, auto_trainer_resources, round_line

    core = LearnerCore({"enabled": True})
    core.note_placement({"state": "pending", "resources": {"CPU": 64.0},
                         "message": "the trainer waits for CPU 64 (free now: CPU 0.2 of 2)"})
    status = core.status()
    assert status["trainer"]["state"] == "pending: the trainer waits for CPU 64 (free now: CPU 0.2 of 2)"
    core.note_placement({"state": "placed", "resources": {"CPU": 0.5}, "message": "the trainer holds CPU 0.5"})
    assert core.status()["trainer"]["state"] == "idle"
    report = {"method": "draft", "published": False, "serving": {"mean_accepted_length": 1.7},
              "candidate": {"mean_accepted_length": 1.6}, "train_traces": 24, "held_out_traces": 8, "seconds": 12.0,
              "loss": 1.0}
    core.store.register_base("draft", {})
    core.finish_round("draft", report, None)
    (kept,) = core.status()["rounds"]
    assert kept["kept"] == "draft@base" and kept["version"] is None and kept["finished_at_trace"] == 0
    assert round_line(kept) == ("round of draft on 24 traces (8 held out, 12 s): kept draft@base (held-out mean "
                                "accepted length: candidate 1.600, serving 1.700)")
    published = core.finish_round("draft", {**report, "published": True}, {})
    assert published == "draft@1" and "published draft@1" in round_line(core.status()["rounds"][-1])
    assert [auto_trainer_resources(f)["num_cpus"] for f in (6.0, 1.0, 0.3, 0.01)] == [1.0, 0.5, 0.15, 0.0]


def test_specray_serve_prints_where_the_trainer_waits_and_each_round(monkeypatch, capsys):
    """What `specray serve --online-learning` prints from the hub's status: the placement once per
    change, each round once."""
    from specray.entrypoints import serving

    rounds = [{"method": "draft", "time": 1.0, "version": "draft@1", "kept": None, "train_traces": 24,
               "held_out_traces": 8, "seconds": 30.0, "serving": {"mean_accepted_length": 1.6},
               "candidate": {"mean_accepted_length": 1.8}}]
    pending = {"state": "pending", "message": "the trainer waits for CPU 64 (free now: CPU 0.2 of 2); lower "
                                              "online_learning.trainer_resources or add resources"}
    replies = iter([{"trainer": {"placement": pending}, "rounds": []},
                    {"trainer": {"placement": pending}, "rounds": rounds},
                    {"trainer": {"placement": {"state": "placed", "message": "the trainer holds CPU 64"}},
                     "rounds": rounds}])
    monkeypatch.setattr(serving, "_http", lambda *a, **k: (200, next(replies)))
    report = serving.LearningReport("http://x", {})
    for _ in range(3):
        report.report()
    assert capsys.readouterr().out.splitlines() == [
        "specray: online learning: the trainer waits for CPU 64 (free now: CPU 0.2 of 2); lower "
        "online_learning.trainer_resources or add resources",
        "specray: online learning: round of draft on 24 traces (8 held out, 30 s): published draft@1 (held-out "
        "mean accepted length: candidate 1.800, serving 1.600)",
        "specray: online learning: the trainer holds CPU 64",
    ]


def test_specray_serve_waits_for_its_trainer_before_ready(monkeypatch, capsys):
    """Before "ready": until the hub has heard from the trainer (its first round then starts as
    soon as traces are there), or the trainer cannot be placed (said once, serving goes on)."""
    from specray.entrypoints import serving

    monkeypatch.setattr(serving.time, "sleep", lambda s: None)
    replies = iter([{"trainer": {"state": "idle", "seen": None}}, {"trainer": {"state": "idle", "seen": None}},
                    {"trainer": {"state": "idle", "seen": 12.5}}])
    monkeypatch.setattr(serving, "_http", lambda *a, **k: (200, next(replies)))
    serving.LearningReport("http://x", {}).wait_for_trainer()
    assert capsys.readouterr().out.startswith("specray: online learning: the trainer is up (")
    pending = {"state": "pending: the trainer waits for CPU 64", "seen": None,
               "placement": {"state": "pending", "message": "the trainer waits for CPU 64"}}
    monkeypatch.setattr(serving, "_http", lambda *a, **k: (200, {"trainer": pending, "rounds": []}))
    serving.LearningReport("http://x", {}).wait_for_trainer()
    assert capsys.readouterr().out.splitlines() == ["specray: online learning: the trainer waits for CPU 64"]
