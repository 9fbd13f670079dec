"""Tensor parallelism over Ray actors: ranks as processes on (fake) GPUs, joined by gloo.

* Through a Coordinator at TP 2 (the draft whole in rank 0): greedy output equals HF generate
  for every method with weights here, ragged prompts at batch 1 and 3; each rank is its own
  process on its own GPU bundle, on one node.
* Every entry point: CLI ``generate``, HTTP (the draft split with the target), batch jobs (the
  draft in an actor of its own), and the Python handles above; ``serve --once``, the real
  command in a Ray of its own, is tests/test_serve_cli.py's (one's own checkpoint at TP 2).
* A rank lost mid-stream: that replica's requests are replayed on a rebuilt group, greedy
  output unchanged; later requests succeed.
* A layout the cluster cannot host is refused at start-up naming the resource and amount.

tests/test_tensor_parallel.py covers the split and the control plane in one process.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
import ray

from specray.actors.coordinator import Coordinator, StartError
from specray.cluster.placement import Layout, PlacementError, check_feasible
from tests.conftest import hf_greedy
from tests.test_actors import GREEDY, PROMPTS, shutdown

pytestmark = pytest.mark.timeout(600)
TP2 = {"tensor_parallel_size": 2}
METHODS = [{"method": "none"}, {"method": "draft", "num_speculative_tokens": 3}, {"method": "ngram"},
           {"method": "medusa"}, {"method": "eagle", "dynamic_tree": True}, {"method": "eagle3", "tree": "chain"},
           {"method": "lookahead"}, {"method": "suffix"}]


@pytest.fixture(scope="module")
def references(tiny_pair):
    return [hf_greedy(tiny_pair[0], p, GREEDY["max_tokens"]) for p in PROMPTS]


@pytest.fixture(scope="module")
def heads(tiny_pair, tmp_path_factory) -> dict:
    """Random Medusa, EAGLE and EAGLE-3 heads for the tiny target, in their public layouts."""
    from tests.test_eagle import random_head
    from tests.test_eagle3 import random_head3
    from tests.test_medusa import random_heads

    root = tmp_path_factory.mktemp("tp-heads")
    random_heads().save(root / "medusa")
    random_head(tiny_pair[0]).save(root / "eagle")
    random_head3(tiny_pair[0]).save(root / "eagle3")
    return {"medusa": str(root / "medusa"), "checkpoints": {"eagle": str(root / "eagle"), "eagle3": str(root / "eagle3")}}


def every_method(c, references) -> None:
    """Each method at batch 3 (ragged prompts together) and batch 1, 12 tokens each."""
    short = {**GREEDY, "max_tokens": 12}
    for spec in METHODS:
        outs = ray.get(c.generate.remote(PROMPTS[:3], short, spec))
        assert [o["token_ids"] for o in outs] == [r[:12] for r in references[:3]], spec
        out = ray.get(c.generate.remote(PROMPTS[3:4], short, spec))[0]
        assert out["token_ids"] == references[3][:12], spec


# Serve's proxy starts first, on a quiet cluster (it must be ready within Serve's own timeouts).
def test_http_at_tp2_with_the_draft_split_too(server, tiny_tok, tiny_pair):
    """draft_tensor_parallel_size 2 (from --speculative-config's key): the draft split over the
    target's ranks, driven by rank 0; no draft actor."""
    from ray import serve

    from specray.entrypoints.app import build_app
    from tests.conftest import decode, encode

    small = {"num_gpus": 0, "num_cpus": 0.25}
    cfg = {"model_name": "tp2", **TP2, "speculative-config": {"method": "draft", "draft_tensor_parallel_size": 2},
           "engine": {**tiny_tok, "max_num_seqs": 2, "placement": {"target": small}}}
    serve.run(build_app(cfg), name="tp2", route_prefix="/tp2")
    try:
        prompt = "abcdefabcdef"
        deadline = time.monotonic() + 300
        while True:
            r = httpx.post(f"{server}/tp2/v1/completions", timeout=120, json={
                "model": "tp2", "prompt": prompt, "max_tokens": 10, "temperature": 0})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == decode(hf_greedy(tiny_pair[0], encode(prompt), 10))
        (metrics,) = r.json()["speculation_metrics"]
        assert metrics["method"] == "draft" and metrics["num_drafts"] > 0
    finally:
        serve.delete("tp2")


@pytest.fixture(scope="class")
def colocated_tp2(ray_session, tiny_tok, heads):
    """One colocated TP 2 coordinator for the class's tests, given back when the class ends:
    the tests after it need both GPUs. Its step is ``compile``: the all-reduces are functional
    collectives traced into each graph (fullgraph: a graph break would raise), on every rank,
    for every method; the eager step at TP 2 is the other entry points' below."""
    c = Coordinator.remote({**tiny_tok, **heads, **TP2, "step": "compile", "max_num_seqs": 3,
                            "placement": {"mode": "colocated"}})
    yield c
    shutdown(c)


class TestColocatedTP2:
    def test_colocated_tp2_every_method(self, colocated_tp2, references):
        c = colocated_tp2
        every_method(c, references)
        engine = ray.get(c.workers.remote())["engine"]
        tp = ray.get(engine.tensor_parallel.remote())
        (rank1,) = tp["actors"]
        # Two processes, two GPU bundles; one control message per forward, not per runner call.
        assert ray.get(rank1.gpu_ids.remote()) != ray.get(engine.gpu_ids.remote())
        assert ray.get(rank1.node_id.remote()) == ray.get(engine.node_id.remote())
        assert tp["ranks"][0]["messages"] == tp["rank0"]["messages"] > 0
        assert ray.get(engine.describe.remote())["proposers"]["draft"].endswith("DraftModelProposer")

    def test_structured_outputs_at_tp2(self, colocated_tp2, tiny_pair, char_tokenizer):
        """Constrained and free rows together at TP 2 (compiled step): the constrained target."""
        from tests.test_structured import constrained_outputs_match

        constrained_outputs_match(colocated_tp2, tiny_pair[0], char_tokenizer, ["draft", "medusa", "ngram"])


def test_a_lost_rank_replays_the_replicas_requests(ray_session, tiny_checkpoints, tiny_pair, references):
    """Kill rank 1 of a colocated TP 2 group (eager step) during streams: every request finishes
    with the undisturbed greedy output (replayed on a rebuilt group); later requests succeed."""
    c = Coordinator.remote({**tiny_checkpoints, **TP2, "max_num_seqs": 4, "placement": {"mode": "colocated"}})
    try:
        ray.get(c.ready.remote())
        long = {**GREEDY, "max_tokens": 40}
        prompts = PROMPTS[:4]
        refs = [hf_greedy(tiny_pair[0], p, long["max_tokens"]) for p in prompts]
        streams = [c.stream.remote(p, long, {"method": m}) for p, m in zip(prompts, ["none", "draft", "ngram", "draft"])]
        first = [ray.get(next(s)) for s in streams]  # every request is under way
        engine = ray.get(c.workers.remote())["engine"]
        rank1 = ray.get(engine.tensor_parallel.remote())["actors"][0]
        ray.kill(rank1, no_restart=True)
        for f, s, ref in zip(first, streams, refs):
            tokens = f["new_token_ids"] + sum((ray.get(r)["new_token_ids"] for r in s), [])
            assert tokens == ref
        stats = ray.get(c.stats.remote())
        assert stats["restarts"]["engine"] >= 1
        outs = ray.get(c.generate.remote(PROMPTS[:3], GREEDY, {"method": "draft"}))
        assert [o["token_ids"] for o in outs] == references[:3]
        new_engine = ray.get(c.workers.remote())["engine"]
        assert ray.get(new_engine.tensor_parallel.remote())["actors"][0] != rank1  # a new group
    finally:
        shutdown(c)


# -- placement -------------------------------------------------------------------------------------
def test_what_cannot_be_hosted_or_split_is_refused_at_start(ray_session, tiny_checkpoints):
    """Before anything is reserved or loaded, naming the reason (a layout that needs more GPUs
    than the cluster has is refused naming the resource and amount: the CLI test below)."""
    odd = Coordinator.remote({**tiny_checkpoints, "tensor_parallel_size": 3, "placement": {"mode": "colocated"}})
    with pytest.raises(StartError, match="the target .* cannot be split: .*4 attention heads do not divide over 3"):
        ray.get(odd.ready.remote())
    ray.kill(odd)
    # Enough GPUs in all, but no node with the TP group's share (it is STRICT_PACK).
    layout = Layout({"target": [{"CPU": 1, "GPU": 1}] * 2, "draft": [{"CPU": 1, "GPU": 1}]}, tp_role="target")
    nodes = [{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}]
    with pytest.raises(PlacementError, match="tensor_parallel_size 2 needs 2 GPU on one node .* the largest node has 1"):
        check_feasible(layout, nodes, 2)
    check_feasible(layout, [{"CPU": 8, "GPU": 2}, {"CPU": 8, "GPU": 1}], 2)


# -- entry points ------------------------------------------------------------------------------------
def test_cli_generate_with_tensor_parallel_size(ray_session, tiny_tok, tiny_pair, tmp_path, capsys):
    from specray.entrypoints.cli import main
    from tests.conftest import encode

    prompt = "abcabcab"
    base = ["generate", "--target", tiny_tok["target"], "--tokenizer", tiny_tok["tokenizer"], "--draft",
            tiny_tok["draft"], "--prompt", prompt, "--max-tokens", "12", "--ignore-eos", "--json", "--method", "draft",
            "--tensor-parallel-size", "2"]
    # Two GPUs here: the separate layout (a third for the draft) cannot be hosted: the
    # coordinator refuses it at start, naming the resource and amount, and the CLI says so.
    assert main(base) == 2
    err = capsys.readouterr().err
    assert re.search(r"placement needs 3 GPU \(.*\) but the cluster has 2; placement mode colocated", err), err
    config = tmp_path / "colocated.yaml"
    config.write_text("engine:\n  placement:\n    mode: colocated\n")
    assert main([*base, "--config", str(config)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(tiny_pair[0], encode(prompt), 12)
    assert out["metrics"]["num_drafts"] > 0


def test_cli_flags_and_speculative_config_reach_the_config():
    from specray.entrypoints.cli import build_parser
    from specray.entrypoints.flags import engine_settings

    args = build_parser()[0].parse_args(
        ["serve", "-tp", "2", "--speculative-config", '{"method": "draft", "draft_tensor_parallel_size": 2}'])
    cfg = engine_settings(args, {}).engine
    assert (cfg.tensor_parallel_size, cfg.draft_tensor_parallel_size) == (2, 2)
    assert cfg.default_speculation.method == "draft"
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1 or tensor_parallel_size"):
        engine_settings(build_parser()[0].parse_args(["serve", "--speculative-config",
                                                      '{"method": "draft", "draft_tensor_parallel_size": 2}']), {})


def test_batch_job_at_tp2_with_the_draft_in_its_own_actor(ray_session, tiny_checkpoints, tiny_pair, tmp_path):
    """The separate layout, draft_tensor_parallel_size 1: the draft model whole in a worker of its
    own (a CPU bundle here: the two GPUs are the target's ranks)."""
    from specray.entrypoints import jobs

    config = tmp_path / "cfg.yaml"
    config.write_text(f"target: {tiny_checkpoints['target']}\ndraft: {tiny_checkpoints['draft']}\n"
                      "tensor-parallel-size: 2\nmax_num_seqs: 3\nplacement:\n  draft:\n    num_gpus: 0\n")
    inp = tmp_path / "in.jsonl"
    methods = ["draft", "ngram", "draft", "none", "draft"]
    inp.write_text("".join(json.dumps({"prompt": p, "sampling": {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
                                       "speculation": {"method": m}}) + "\n" for p, m in zip(PROMPTS, methods)))
    out = tmp_path / "out.jsonl"
    assert jobs.main(["--input", str(inp), "--output", str(out), "--config", str(config)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [o["token_ids"] for o in lines] == [hf_greedy(tiny_pair[0], p, 12) for p in PROMPTS]
    assert sum(o["metrics"]["num_drafts"] for o in lines if o["method"] == "draft") > 0
