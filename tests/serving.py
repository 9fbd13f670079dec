"""Ray Serve for the tests, shared: one HTTP proxy and a few applications per pytest process,
each started on first use and kept for the rest of the session (a Serve application is an
ingress, an engine replica and its workers: processes that import torch, seconds each).

* ``main_url`` — the tiny pair and every method's weights (random heads) in the separate
  layout on CPU shares: what a server does per request, for every method.
* ``guarded_url`` — a colocated engine that takes one sequence at a time, queues one more,
  and wants an API key: admission, overload and keys.
* ``colocated_url`` — two colocated replicas with a 64-token context and one suffix tree
  shared through its actor: suffix decoding's cross-replica drafts, lookahead's window.
* ``demo_url`` — the demo pair (a real tokenizer and chat template), auto tool choice on (hermes).

No shared application reserves a fake GPU (``cpu_placement``): tests that place models on
GPUs get both of the session's. Tests that need a configuration of their own run it on the
same proxy under their own route prefix and delete it when done.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import free_port, save_char_tokenizer

MAIN, GUARDED, COLOCATED, DEMO = "tiny", "tiny-guarded", "tiny-colocated", "specray-demo"
KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_CONTEXT = 4096
"""The guarded app's models take long prompts/outputs: its requests can be slow on purpose."""
SHORT_CONTEXT = 64
"""The colocated app's context: a request past it is a 400 naming it."""
SUFFIX_TREE = "suffix-test-http"


def cpu_placement(mode: str = "separate") -> dict:
    small = {"num_gpus": 0, "num_cpus": 0.25}
    return {"mode": mode, "target": small, "draft": small, "ngram_cpus": 0.25}


def wait_until_serving(url: str, model: str, headers=None, timeout: float = 600) -> None:
    """A readiness wait: the first request also starts the replica's coordinator and workers."""
    deadline = time.monotonic() + timeout
    body = {"model": model, "prompt": "abc", "max_tokens": 2, "temperature": 0}
    while True:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not serve within {timeout}s")
        time.sleep(0.5)


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["type"]
    for word in words:
        assert word in err["message"], err
    return err


def sse_events(lines) -> list:
    """Parse server-sent events: dicts, and the final "[DONE]" marker as a string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def run_app(server: str, config: dict, name: str, model: str, headers=None) -> str:
    """``config`` as a Serve application under ``/name``, serving; its URL."""
    from ray import serve

    from specray.entrypoints.app import build_app

    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    url = f"{server}/{name}"
    wait_until_serving(url, model, headers=headers)
    return url


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def server(ray_session):
    """Ray Serve's HTTP proxy on a free loopback port, for the whole session."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def tiny_methods(tiny_tok, tiny_pair, tmp_path_factory) -> dict:
    """The tiny pair with its tokenizer and random weights of every method for its target."""
    from tests.test_dflash import random_drafter as random_dflash
    from tests.test_dspark import random_dspark
    from tests.test_eagle import random_head
    from tests.test_eagle3 import random_head3
    from tests.test_medusa import random_heads
    from tests.test_pard import pard_model
    from tests.test_redrafter import random_drafter

    root = tmp_path_factory.mktemp("tiny-methods")
    target, draft = tiny_pair
    random_heads().save(root / "medusa")
    random_head(target).save(root / "eagle")
    random_head3(target).save(root / "eagle3")
    random_drafter().save(root / "redrafter")
    pard_model(draft).save_pretrained(root / "pard")
    random_dflash(target).save(root / "dflash", num_target_layers=2)
    random_dspark(target).save(root / "dspark", num_target_layers=2)
    return {**tiny_tok, "medusa": str(root / "medusa"),
            "checkpoints": {m: str(root / m) for m in ("eagle", "eagle3", "redrafter", "pard", "dflash", "dspark")}}


@pytest.fixture(scope="session")
def main_url(server, tiny_methods):
    """Separate target/draft/PARD/n-gram actors (the heads and DFlash beside the target), 4
    sequences, no API key; the toy failing method (tests/failing_method.py) served too."""
    from tests.failing_method import runtime_env

    cfg = {"model_name": MAIN, "max_ongoing_requests": 16, "max_sequences_per_request": 600,
           "engine": {**tiny_methods, "max_num_seqs": 4, "placement": cpu_placement("separate")},
           "runtime_env": runtime_env()}
    return run_app(server, cfg, "main", MAIN)


@pytest.fixture(scope="session")
def long_tok(tmp_path_factory) -> dict:
    """A tiny pair with a 4096-token context (long, slow requests on purpose)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny-long")
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LONG_CONTEXT,
            initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        LlamaForCausalLM(cfg).eval().save_pretrained(root / name)
    save_char_tokenizer(root / "tokenizer")
    return {"target": str(root / "target"), "draft": str(root / "draft"), "tokenizer": str(root / "tokenizer")}


@pytest.fixture(scope="session")
def guarded_url(server, long_tok):
    """Colocated engine, ONE sequence at a time, a queue bound of one, and an API key. The
    metrics tests count what changed while they ran (other tests use it too)."""
    cfg = {"model_name": GUARDED, "api_key": KEY, "max_ongoing_requests": 4, "max_queued_requests": 1,
           "max_waiting_sequences": 1, "engine": {**long_tok, "max_num_seqs": 1, "placement": cpu_placement("colocated")}}
    return run_app(server, cfg, "guarded", GUARDED, headers=AUTH)


@pytest.fixture(scope="session")
def colocated_url(server, tiny_tok):
    """Two colocated replicas, a 64-token context, one suffix tree shared through its actor."""
    from specray.actors.suffix_cache import drop_shared_suffix_cache

    cfg = {"model_name": COLOCATED, "num_replicas": 2,
           "engine": {**tiny_tok, "max_num_seqs": 2, "max_model_len": SHORT_CONTEXT,
                      "placement": cpu_placement("colocated"),
                      "suffix_cache": {"name": SUFFIX_TREE, "sync_every_requests": 1}}}
    yield run_app(server, cfg, "colocated", COLOCATED)
    drop_shared_suffix_cache(SUFFIX_TREE)


@pytest.fixture(scope="session")
def demo_url(server, demo_pair):
    """build_app with no models: the demo pair (separate actors, small CPU shares); auto tool
    choice on, with the parser of the calls its chat template asks for."""
    cfg = {"model_name": DEMO, "enable_auto_tool_choice": True, "tool_call_parser": "hermes",
           "engine": {"max_num_seqs": 4, "placement": cpu_placement("separate")}}
    return run_app(server, cfg, "demo", DEMO)


# -- coordinators ----------------------------------------------------------------------------
SUFFIX_TREE_ACTORS = "suffix-test-separate"


@pytest.fixture(scope="session")
def tiny_coordinator(ray_session, tiny_methods):
    """A Coordinator in the separate layout (target, draft, PARD, n-gram and lookahead workers
    of their own; the heads beside the target) with every method's weights, 3 sequences, a
    suffix tree actor of its own, on CPU shares: what runs behind Ray, per method (the toy
    failing method of tests/failing_method.py too)."""
    from specray.actors.coordinator import Coordinator
    from specray.actors.suffix_cache import drop_shared_suffix_cache
    from tests.failing_method import runtime_env

    c = Coordinator.options(runtime_env=runtime_env()).remote({**tiny_methods, "max_num_seqs": 3, "placement": cpu_placement("separate"),
                            "suffix_cache": {"name": SUFFIX_TREE_ACTORS, "sync_every_requests": 1}})
    yield workers_up(c)
    stop_coordinator(c)
    drop_shared_suffix_cache(SUFFIX_TREE_ACTORS)


@pytest.fixture(scope="session")
def tiny_colocated_coordinator(ray_session, tiny_methods):
    """The same weights in the colocated layout: every model in one engine worker."""
    from specray.actors.coordinator import Coordinator
    from tests.failing_method import runtime_env

    c = Coordinator.options(runtime_env=runtime_env()).remote({**tiny_methods, "max_num_seqs": 3, "placement": cpu_placement("colocated")})
    yield workers_up(c)
    stop_coordinator(c)


def workers_up(coordinator):
    """A readiness wait: every worker of ``coordinator`` constructed (an engine that starts
    decodes plainly until its proposer workers are up, however long a loaded machine takes them,
    so tests that count drafts start after this). Returns ``coordinator``."""
    import ray

    ray.get([h.__ray_ready__.remote() for h in ray.get(coordinator.workers.remote()).values()])
    return coordinator


def stop_coordinator(c) -> None:
    import ray

    try:
        ray.get(c.shutdown.remote(), timeout=120)
    finally:
        ray.kill(c)
