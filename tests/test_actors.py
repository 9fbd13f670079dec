"""The Ray actor system: placement, lossless greedy through the coordinator, faults."""

import json
import subprocess
import sys
import time

import pytest
import ray

from specray.actors.coordinator import Coordinator
from tests.conftest import hf_greedy

GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [5, 5, 6, 5, 5], [30, 31]]


@pytest.fixture(scope="module")
def references(tiny_pair):
    return [hf_greedy(tiny_pair[0], p, GREEDY["max_tokens"]) for p in PROMPTS]


@pytest.fixture(scope="module")
def coordinator(ray_session, tiny_checkpoints):
    c = Coordinator.remote({**tiny_checkpoints, "max_num_seqs": 3})
    ray.get(c.ready.remote())
    yield c
    shutdown(c)


def shutdown(coordinator) -> None:
    """Shut a coordinator down and wait until its placement group's GPUs are free again."""
    ray.get(coordinator.shutdown.remote())
    ray.kill(coordinator)
    deadline = time.monotonic() + 120
    while ray.available_resources().get("GPU", 0) < ray.cluster_resources().get("GPU", 0):
        if time.monotonic() > deadline:
            raise TimeoutError("GPUs not released after killing the coordinator")
        time.sleep(0.1)


def test_target_and_draft_hold_different_gpus(coordinator):
    workers = ray.get(coordinator.workers.remote())
    target_gpus = ray.get(workers["target"].gpu_ids.remote())
    draft_gpus = ray.get(workers["draft"].gpu_ids.remote())
    assert len(target_gpus) == len(draft_gpus) == 1 and target_gpus != draft_gpus


def test_concurrent_requests_arriving_at_different_times(coordinator, references):
    methods = ["none", "draft", "ngram", "draft", "ngram"]
    refs = []
    for i, (prompt, method) in enumerate(zip(PROMPTS, methods)):
        spec = {"method": method, "num_speculative_tokens": 1 + i % 4}
        refs.append(coordinator.generate.remote([prompt], GREEDY, spec))
        time.sleep(0.05 * i)  # later requests join a running batch
    outs = [ray.get(r)[0] for r in refs]
    assert [o["token_ids"] for o in outs] == references
    assert sum(o["metrics"]["num_drafts"] for o in outs) > 0


def test_stream_yields_incremental_tokens(coordinator, references):
    deltas = [ray.get(ref)["new_token_ids"] for ref in coordinator.stream.remote(PROMPTS[0], GREEDY, {"method": "draft"})]
    assert len(deltas) > 2 and sum(deltas, []) == references[0]


def test_bad_parameters_raise_value_error(coordinator):
    with pytest.raises(ValueError, match="unknown speculation method"):
        ray.get(coordinator.generate.remote([[1, 2]], GREEDY, {"method": "bogus"}))
    with pytest.raises(ValueError, match="max_tokens"):
        ray.get(coordinator.generate.remote([[1, 2]], {"max_tokens": -1}))


def test_a_request_list_with_one_bad_prompt_runs_none_of_it(coordinator):
    """Admitted whole or refused whole: every record is made before any is queued."""
    with pytest.raises(ValueError, match="prompt token ids"):
        ray.get(coordinator.generate.remote([[1, 2], [3, 4], [10**6]], GREEDY))
    assert ray.get(coordinator.stats.remote())["in_flight"] == 0
    assert ray.get(coordinator.generate.remote([[1, 2]], {**GREEDY, "max_tokens": 2}))[0]["token_ids"]


TWO_NODES = r"""
import json, sys, ray
from ray.cluster_utils import Cluster
from specray.actors.coordinator import Coordinator
ckpt, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
cluster.add_node(num_cpus=2, num_gpus=1)
ray.init(address=cluster.address, log_to_driver=False)
try:
    c = Coordinator.options(num_cpus=0).remote({**ckpt, "placement": {"strategy": "STRICT_SPREAD"}})
    ray.get(c.ready.remote())
    w = ray.get(c.workers.remote())
    nodes = [ray.get(w[r].node_id.remote()) for r in ("target", "draft")]
    outs = ray.get(c.generate.remote(prompts, {"max_tokens": 24, "temperature": 0, "ignore_eos": True},
                                     {"method": "draft", "num_speculative_tokens": 3}))
    print("RESULT " + json.dumps({"nodes": nodes, "tokens": [o["token_ids"] for o in outs]}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow  # starts processes
def test_two_node_placement_matches_single_process(tiny_checkpoints, references):
    """Draft on one simulated node, target on the other (own Ray, in a subprocess)."""
    proc = subprocess.run(
        [sys.executable, "-c", TWO_NODES, json.dumps(tiny_checkpoints), json.dumps(PROMPTS)],
        capture_output=True, text=True, timeout=240,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(line[len("RESULT "):])
    assert result["nodes"][0] != result["nodes"][1]
    assert result["tokens"] == references


@pytest.mark.parametrize("mode", ["separate", "colocated"])
def test_a_long_stream_costs_the_same_per_chunk(ray_session, tmp_path, mode):
    """What the coordinator streams per step is that step's delta: a chunk 500 tokens into a
    stream is no bigger than one at its start (the whole output is never shipped per step)."""
    import pickle

    from tests.conftest import tiny_llama

    model = tiny_llama()
    model.config.max_position_embeddings = 4096  # rotary positions: nothing in the weights bounds them
    model.save_pretrained(tmp_path / "target")
    n = 512
    beside = {"num_gpus": 0, "num_cpus": 0.25}  # the module's coordinator holds both GPUs
    c = Coordinator.remote({"target": str(tmp_path / "target"), "max_num_seqs": 1, "max_model_len": n + 64,
                            "placement": {"mode": mode, "target": beside, "ngram_cpus": 0.25}})
    try:
        chunks = [ray.get(ref) for ref in c.stream.remote(PROMPTS[0], {**GREEDY, "max_tokens": n},
                                                           {"method": "ngram", "num_speculative_tokens": 3})]
        tokens = sum((ch["new_token_ids"] for ch in chunks), [])
        assert len(tokens) == n and chunks[-1]["finish_reason"] == "length"
        assert "token_ids" not in chunks[0] and "prompt_token_ids" not in chunks[0]
        size = [len(pickle.dumps(ch)) for ch in chunks[:-1]]  # the last one carries the metrics
        early, late = max(size[:20]), max(size[-20:])
        assert late <= early + 200, (early, late)  # the whole output would be a kilobyte more
    finally:
        ray.get(c.shutdown.remote())  # (no GPU of its own to wait for)
        ray.kill(c)
