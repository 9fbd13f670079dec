"""The OpenAI-compatible Serve application over HTTP: the official ``openai`` client,
raw HTTP error classes, API keys, overload, client disconnects and ``/metrics``.

Fast tests use tiny random Llama pairs given a 64-symbol tokenizer of their own (one
character per token id), so response *text* identifies the token ids exactly: greedy
results can be compared with Hugging Face ``generate`` without the demo pair. Tests that
need the trained demo pair (a real tokenizer with a chat template) are ``slow``.

The applications are the session's (``tests/serving.py``): one Serve proxy, the main app (every
method), the guarded one (one sequence, a queue of one, a key) and the demo pair's; a test that
needs a configuration of its own runs it under its own route prefix. Models run on CPU shares;
no fake GPU is reserved.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from tests.conftest import ALPHABET, CHAT_TEMPLATE, decode, encode, hf_greedy, save_char_tokenizer  # noqa: F401
from tests.serving import (  # noqa: F401
    AUTH, DEMO, GUARDED, KEY, LONG_CONTEXT, MAIN, assert_openai_error, cpu_placement, sse_events, wait_until_serving,
)

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from specray.entrypoints.app import build_app  # noqa: E402
from specray.serve.config import ServeConfig  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def client(main_url):
    return openai.OpenAI(base_url=f"{main_url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def target_model(tiny_pair):
    return tiny_pair[0]


def greedy_text(model, prompt_ids, n) -> str:
    return decode(hf_greedy(model, prompt_ids, n))


# -- configuration (no server) ------------------------------------------------------------
def test_autoscaling_typo_is_rejected():
    with pytest.raises(ValidationError, match="max_replica"):
        ServeConfig(autoscaling={"min_replicas": 1, "max_replica": 2})
    with pytest.raises(ValidationError, match="max_replica"):
        build_app({"engine": {"target": "/nonexistent"}, "autoscaling": {"max_replica": 2}})
    with pytest.raises(ValidationError, match="min_replicas"):
        ServeConfig(autoscaling={"min_replicas": 3, "max_replicas": 2})


def test_ingress_admits_what_the_engines_can_hold():
    """Serve's default (5 requests per replica) must not cap the server below its engines."""
    app = build_app({"engine": {"target": "/nonexistent"}, "max_ongoing_requests": 32, "max_queued_requests": 8,
                     "autoscaling": {"max_replicas": 3}})
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    assert (engine.max_ongoing_requests, engine.max_queued_requests) == (32, 8)
    assert ingress.max_ongoing_requests >= 3 * (32 + 8)


def test_example_yaml_args_are_a_valid_config():
    """examples/serve.yaml's application args validate (build_app would use the demo pair)."""
    import pathlib

    doc = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1] / "examples" / "serve.yaml").read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "specray.entrypoints.app:build_app"
    cfg = ServeConfig.model_validate(app["args"])
    assert cfg.autoscaling is not None and cfg.autoscaling.max_replicas >= cfg.autoscaling.min_replicas
    assert cfg.engine.placement.mode in ("separate", "colocated")
    assert doc["http_options"]["host"] == "127.0.0.1"


def test_autoscaling_as_configured_draws_no_warning_from_ray():
    """The autoscaling_config specray hands Ray (the defaults, examples/serve.yaml's) passes
    Ray's own checks without a warning (look_back_period_s was once 5, below Ray's
    metrics_interval_s of 10: a FutureWarning on every `serve run`); a look-back Ray would
    warn about is refused here, naming both fields."""
    import pathlib
    import warnings

    from ray.serve.config import AutoscalingConfig

    doc = yaml.safe_load((pathlib.Path(__file__).resolve().parents[1] / "examples" / "serve.yaml").read_text())
    for given in ({}, doc["applications"][0]["args"]["autoscaling"], {"metrics_interval_s": 2, "look_back_period_s": 3}):
        spec = ServeConfig(autoscaling=given).autoscaling
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            AutoscalingConfig(**spec.model_dump(exclude_none=True))
    for given in ({"look_back_period_s": 5}, {"metrics_interval_s": 20, "look_back_period_s": 15}):
        with pytest.raises(ValidationError, match=r"look_back_period_s \(\d+\) must be greater than metrics_interval_s"):
            ServeConfig(autoscaling=given)


# -- the openai client on the tiny pair ---------------------------------------------------
def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == [MAIN]


def test_completion_greedy_token_ids_all_methods_match_hf(client, target_model, make_engine):
    from specray.engine.params import SamplingParams

    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    ref = greedy_text(target_model, prompt, 20)
    engine_out = make_engine().generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0]
    assert decode(engine_out.token_ids) == ref  # the in-process engine agrees with HF
    for method in ("none", "draft", "ngram"):
        r = client.completions.create(
            model=MAIN, prompt=prompt, max_tokens=20, temperature=0,
            extra_body={"speculation": {"method": method, "num_speculative_tokens": 3}},
        )
        assert r.choices[0].text == ref, method
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 20


def test_medusa_over_http_is_lossless_and_validated(client, main_url, target_model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    ref = greedy_text(target_model, prompt, 20)
    for spec in ({"method": "medusa"}, {"method": "medusa", "tree": "wide"},
                 {"method": "medusa", "medusa_choices": [[0], [1], [0, 0], [0, 0, 0]]}):
        r = client.completions.create(model=MAIN, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"speculation": spec})
        assert r.choices[0].text == ref, spec
        assert r.model_dump()["speculation_metrics"][0]["num_drafts"] > 0, spec
    stream = client.completions.create(model=MAIN, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"speculation": {"method": "medusa", "tree": "chain"}})
    assert "".join(c.choices[0].text for c in stream) == ref
    sampled = client.completions.create(model=MAIN, prompt=prompt, max_tokens=12, temperature=0.8, seed=3,
                                        extra_body={"speculation": {"method": "medusa"}})
    assert sampled.usage.completion_tokens == 12
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 4,
            "speculation": {"method": "medusa", "medusa_choices": [[0, 0, 0, 0, 0]]}}
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=body, timeout=60), 400, "exceeds the 4")
    body["speculation"] = {"method": "medusa", "medusa_choices": [[0], [0]]}
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=body, timeout=60), 400, "twice")


def test_eagle_over_http_is_lossless_and_validated(client, main_url, target_model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    ref = greedy_text(target_model, prompt, 20)
    for spec in ({"method": "eagle"}, {"method": "eagle", "tree": "chain"},
                 {"method": "eagle", "eagle_choices": [[0], [1], [0, 0]]},
                 {"method": "eagle", "dynamic_tree": True, "top_k": 3, "depth": 3, "total_tokens": 8}):
        r = client.completions.create(model=MAIN, prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"speculation": spec})
        assert r.choices[0].text == ref, spec
        assert r.model_dump()["speculation_metrics"][0]["num_drafts"] > 0, spec
    stream = client.completions.create(model=MAIN, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                       extra_body={"speculation": {"method": "eagle", "dynamic_tree": True}})
    assert "".join(c.choices[0].text for c in stream) == ref
    sampled = client.completions.create(model=MAIN, prompt=prompt, max_tokens=12, temperature=0.8, seed=3,
                                        extra_body={"speculation": {"method": "eagle"}})
    assert sampled.usage.completion_tokens == 12
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 4,
            "speculation": {"method": "eagle", "dynamic_tree": True, "tree": "chain"}}
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=body, timeout=60), 400, "dynamic_tree")
    body["speculation"] = {"method": "eagle", "top_k": 0}
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=body, timeout=60), 400, "speculation.top_k")


@pytest.mark.parametrize("spec, bad, words", [
    ({"method": "eagle3", "dynamic_tree": True, "top_k": 4, "depth": 4, "total_tokens": 12},
     {"method": "eagle3", "top_k": 0}, "top_k"),
    ({"method": "redrafter", "num_beams": 4, "draft_len_per_beam": 4},
     {"method": "redrafter", "draft_len_per_beam": 0}, "draft_len_per_beam"),
], ids=["eagle3", "redrafter"])
def test_feature_drafters_over_http(main_url, target_model, spec, bad, words):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 20, "temperature": 0, "speculation": spec}
    r = httpx.post(f"{main_url}/v1/completions", json=body, timeout=120).json()
    assert r["choices"][0]["text"] == greedy_text(target_model, prompt, 20)
    assert r["speculation_metrics"][0]["num_drafts"] > 0
    bad_body = {**body, "speculation": bad}
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=bad_body, timeout=60), 400, words)


def test_block_drafters_over_http(main_url, target_model):
    """PARD (vLLM's spelling), DFlash and DSpark draft over HTTP; their bad options are 400s."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 20, "temperature": 0}
    for spec, method in (({"method": "draft_model", "parallel_drafting": True, "num_speculative_tokens": 4}, "pard"),
                         ({"method": "dflash", "num_speculative_tokens": 5}, "dflash"),
                         ({"method": "dspark", "num_speculative_tokens": 5}, "dspark")):
        r = httpx.post(f"{main_url}/v1/completions", json={**body, "speculation": spec}, timeout=60).json()
        assert r["choices"][0]["text"] == greedy_text(target_model, prompt, 20), spec
        assert r["speculation_metrics"][0]["method"] == method and r["speculation_metrics"][0]["num_drafts"] > 0
    bad = {**body, "speculation": {"method": "draft", "parallel_drafting": "sometimes"}}
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=bad, timeout=60), 400, "parallel_drafting")
    bad["speculation"] = {"method": "dflash", "num_speculative_tokens": 6}  # the drafter's block is 6: 5 drafts
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=bad, timeout=60), 400, "num_speculative_tokens")


def test_completion_text_prompt_and_default_max_tokens(client, target_model):
    r = client.completions.create(model=MAIN, prompt="helloWorld", temperature=0)
    assert r.choices[0].text == greedy_text(target_model, encode("helloWorld"), 16)  # OpenAI default: 16
    assert r.object == "text_completion" and r.id.startswith("cmpl-")


def test_per_request_speculation_reports_drafts(client, target_model):
    prompt = [5, 5, 6, 5, 5, 6, 5, 5]
    r = client.completions.create(
        model=MAIN, prompt=prompt, max_tokens=24, temperature=0,
        extra_body={"speculation": {"method": "draft", "num_speculative_tokens": 3}},
    )
    (m,) = r.model_dump()["speculation_metrics"]
    assert m["num_drafts"] > 0 and 0 < m["num_draft_tokens"] <= 3 * m["num_drafts"]
    assert 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]
    assert r.choices[0].text == greedy_text(target_model, prompt, 24)
    plain = client.completions.create(
        model=MAIN, prompt=prompt, max_tokens=24, temperature=0, extra_body={"speculation": {"method": "none"}}
    )
    assert plain.model_dump()["speculation_metrics"][0]["num_drafts"] == 0


def test_streaming_with_client_matches_non_streamed(client):
    kwargs = dict(model=MAIN, prompt="abcabcab", max_tokens=30, temperature=0,
                  extra_body={"speculation": {"method": "ngram", "num_speculative_tokens": 3}})
    full = client.completions.create(**kwargs).choices[0].text
    pieces, reasons = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert len([p for p in pieces if p]) >= 3
    assert "".join(pieces) == full and reasons[-1] == "length"


def test_streaming_raw_sse_is_incremental(main_url, target_model):
    body = {"model": MAIN, "prompt": [7, 8, 9], "max_tokens": 200, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculation": {"method": "none"}}
    start = time.monotonic()
    arrivals, lines = [], []
    with httpx.stream("POST", f"{main_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            lines.append(line)
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - start)
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == greedy_text(target_model, [7, 8, 9], 200)
    assert len(chunks) >= 10 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 200, "total_tokens": 203}
    # Tokens arrive as they are made, not all at the end: a buffered stream delivers every
    # chunk in one read, at one moment.
    assert len({round(t, 3) for t in arrivals}) >= 10, arrivals[:3] + arrivals[-3:]


def test_a_vllm_style_request(client, main_url, target_model):
    """What a tool written for vLLM sends: its sampling extensions are honoured (the repetition
    penalty as HF generate's, stop strings kept), the fields specray cannot honour accepted, and
    with continuous_usage_stats every chunk carries its usage so far."""
    import torch

    prompt = encode("abcabcab")
    with torch.no_grad():
        hf = target_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                                   attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    ref = decode(hf[0, len(prompt):].tolist())
    extra = {"repetition_penalty": 1.3, "min_tokens": 2, "skip_special_tokens": True, "top_k": -1,
             "priority": 0, "speculation": {"method": "draft"}}
    r = client.completions.create(model=MAIN, prompt="abcabcab", max_tokens=12, temperature=0, extra_body=extra)
    assert r.choices[0].text == ref
    stop = ref[3:5]
    kept = client.completions.create(model=MAIN, prompt="abcabcab", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={**extra, "include_stop_str_in_output": True})
    assert kept.choices[0].text == ref[: ref.index(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"
    body = {"model": MAIN, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "presence_penalty": 0.5, "frequency_penalty": 0.5}
    with httpx.stream("POST", f"{main_url}/v1/chat/completions", json=body, timeout=60) as resp:
        events = sse_events(resp.iter_lines())
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all("usage" in c for c in chunks)
    texts = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[: i + 1]) for i in range(len(chunks))]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [len(t) for t in texts]  # one character a token
    assert all(c["usage"]["prompt_tokens"] == len("helloZZ") for c in chunks)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10


def test_n_choices_with_seed(client):
    kwargs = dict(model=MAIN, prompt="abcdef", max_tokens=12, temperature=1.0, n=3, seed=1234,
                  extra_body={"speculation": {"method": "draft", "num_speculative_tokens": 2}})
    r = client.completions.create(**kwargs)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert all(len(t) == 12 for t in texts) and len(set(texts)) > 1
    assert r.usage.completion_tokens == 36 and len(r.model_dump()["speculation_metrics"]) == 3
    again = client.completions.create(**kwargs)  # a seed makes sampling reproducible
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts


def test_n_choices_streamed(main_url):
    # A seed reproduces sampling for a fixed method and length (the self-tuning length varies with load).
    body = {"model": MAIN, "prompt": "xyz", "max_tokens": 8, "temperature": 0.8, "n": 2, "seed": 3, "stream": True,
            "speculation": {"method": "draft", "num_speculative_tokens": 2}}
    with httpx.stream("POST", f"{main_url}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    r2 = httpx.post(f"{main_url}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert texts == {c["index"]: c["text"] for c in r2["choices"]}


def test_chat_completion_on_tiny_template(client, target_model):
    messages = [{"role": "system", "content": "abc"}, {"role": "user", "content": "hello"}]
    prompt = encode("abchelloZZ")  # CHAT_TEMPLATE rendered
    ref = greedy_text(target_model, prompt, 10)
    r = client.chat.completions.create(model=MAIN, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"speculation": {"method": "draft", "num_speculative_tokens": 3}})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MAIN, messages=messages, max_completion_tokens=10, temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == ref


# -- raw HTTP errors: each class answered in OpenAI's shape, then the server still serves --
ERRORS = [  # (id, body patch or raw bytes, status, the error's param, words of its message)
    ("malformed json", b'{"model": "tiny", "prompt": [1, 2', 400, None, ["malformed JSON"]),
    ("not an object", b"[1, 2, 3]", 400, None, ["object"]),
    ("wrong type", {"max_tokens": "ten"}, 400, "max_tokens", ["max_tokens", "integer"]),
    ("temperature range", {"temperature": 5}, 400, "temperature", ["temperature", "2"]),
    ("top_p range", {"top_p": 0}, 400, "top_p", ["top_p", "greater than 0"]),
    ("n range", {"n": 0}, 400, "n", ["n: ", "greater than or equal to 1"]),
    ("negative max_tokens", {"max_tokens": -1}, 400, "max_tokens", ["max_tokens"]),
    ("prompt too long", {"prompt": [1] * 300}, 400, "prompt", ["prompt", "300", "256"]),
    ("token id out of vocab", {"prompt": [1, 64]}, 400, "prompt", ["prompt token ids"]),
    ("empty prompt", {"prompt": []}, 400, "prompt", ["prompt", "empty"]),
    ("unknown model", {"model": "gpt-17"}, 404, "model", ["model", "gpt-17"]),
    ("unknown speculation method", {"speculation": {"method": "bogus"}}, 400, "speculation.method",
     ["speculation method", "bogus"]),
    ("speculation k range", {"speculation": {"method": "draft", "num_speculative_tokens": 0}}, 400,
     "speculation.num_speculative_tokens", ["speculation.num_speculative_tokens"]),
    ("unknown field", {"frobnicate": 1}, 400, "frobnicate", ["frobnicate", "Extra inputs"]),
    ("unknown speculation field", {"speculation": {"method": "draft", "k": 2}}, 400, "speculation.k",
     ["speculation.k"]),
    ("penalty range", {"presence_penalty": 2.5}, 400, "presence_penalty", ["presence_penalty"]),
    ("chat-only field", {"tool_choice": "auto"}, 400, "tool_choice", ["Extra inputs"]),
    ("bad prompt form", {"prompt": [[1, 2], "x"]}, 400, "prompt", ["prompt: must be a string, a list of strings"]),
    ("empty prompt in a list", {"prompt": [[1, 2], []]}, 400, "prompt", ["prompt: a prompt in the list is empty"]),
    ("logprobs range", {"logprobs": 21}, 400, "logprobs", ["logprobs", "20"]),
    ("nested 5000 deep", b'{"model": "tiny", "prompt": [1], "speculation": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     400, None, ["nested too deeply"]),
    ("nested 200 deep", {"speculation": {"method": "draft", "x": json.loads("[" * 200 + "]" * 200)}}, 400,
     "speculation.x", ["speculation.x"]),
    ("lone surrogate", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 3}', 400, "prompt", ["Unicode"]),
    ("seed past int64", {"seed": 2**80}, 400, "seed", ["seed"]),
    ("boolean max_tokens", {"max_tokens": True}, 400, "max_tokens", ["valid integer"]),
    ("string stream", {"stream": "yes"}, 400, "stream", ["valid boolean"]),
    ("stop token id past the vocabulary", {"stop_token_ids": [64]}, 400, "stop_token_ids", ["[0, 64)"]),
]


@pytest.mark.parametrize("name, patch, status, param, words", ERRORS, ids=[e[0] for e in ERRORS])
def test_error_then_success(main_url, name, patch, status, param, words):
    good = {"model": MAIN, "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    url = f"{main_url}/v1/completions"
    if isinstance(patch, bytes):
        r = httpx.post(url, content=patch, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json={**good, **patch}, timeout=60)
    err = assert_openai_error(r, status, *words)
    assert err["param"] == param
    ok = httpx.post(url, json=good, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 3


def test_stream_request_errors_are_statuses_not_broken_streams(main_url):
    body = {"model": MAIN, "prompt": [1] * 300, "max_tokens": 3, "stream": True}
    r = httpx.post(f"{main_url}/v1/completions", json=body, timeout=60)
    assert_openai_error(r, 400, "prompt")


def test_chat_errors(main_url):
    url = f"{main_url}/v1/chat/completions"
    assert_openai_error(httpx.post(url, json={"model": MAIN, "messages": []}, timeout=60), 400, "messages")
    bad_role = {"model": MAIN, "messages": [{"role": "robot", "content": "a"}]}
    assert_openai_error(httpx.post(url, json=bad_role, timeout=60), 400, "messages.0.role")


def test_client_raises_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="abc", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MAIN, prompt="abc", max_tokens=2, temperature=5)


def test_max_tokens_beyond_the_context_is_a_400_naming_both_numbers(main_url, client, target_model):
    """As vLLM and OpenAI answer: prompt + max_tokens over the context is refused, never clamped."""
    url = f"{main_url}/v1/completions"
    body = {"model": MAIN, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1_000_000_000}
    for stream in (False, True):  # streamed: a status code, not a broken stream
        err = assert_openai_error(httpx.post(url, json={**body, "stream": stream}, timeout=60), 400,
                                  "maximum context length is 256 tokens", "1000000005 tokens",
                                  "5 in the prompt", "1000000000 in the completion")
        assert err["param"] == "max_tokens"
    # Text prompts count in tokens ("helloWorld" is 10): 10 + 247 = 257 is one too many; 246 fills it.
    with pytest.raises(openai.BadRequestError, match="257 tokens"):
        client.completions.create(model=MAIN, prompt="helloWorld", max_tokens=247)
    full = client.completions.create(model=MAIN, prompt="helloWorld", max_tokens=246, temperature=0)
    assert full.usage.completion_tokens == 246 and full.choices[0].finish_reason == "length"
    chat = f"{main_url}/v1/chat/completions"
    messages = [{"role": "user", "content": "hello"}]  # "helloZZ": 7 tokens
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(chat, json={"model": MAIN, "messages": messages, field: 250}, timeout=60)
        err = assert_openai_error(r, 400, "256 tokens", "257 tokens", "7 in the prompt", "250 in the completion")
        assert err["param"] == field
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MAIN, messages=messages, max_tokens=10**6)


def test_without_max_tokens_chat_runs_to_the_context_and_completions_get_16(client, target_model):
    messages = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MAIN, messages=messages, temperature=0)  # OpenAI: up to the context
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (7, 256 - 7)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == greedy_text(target_model, encode("helloZZ"), 256 - 7)
    # A completion without max_tokens gets 16 (OpenAI's default), cut to the room a long prompt
    # leaves: the client asked for no number, so there is nothing to refuse.
    r = client.completions.create(model=MAIN, prompt=[5] * 250, temperature=0)
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == greedy_text(target_model, [5] * 250, 6)


def test_health(main_url):
    assert httpx.get(f"{main_url}/health", timeout=30).json() == {"status": "ok"}


# -- API key --------------------------------------------------------------------------------
def test_api_key(guarded_url):
    body = {"model": GUARDED, "prompt": "abc", "max_tokens": 2, "temperature": 0}
    url = f"{guarded_url}/v1/completions"
    assert_openai_error(httpx.post(url, json=body, timeout=60), 401, "API key")
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(httpx.post(url, json=body, headers=wrong, timeout=60), 401)
    assert_openai_error(httpx.get(f"{guarded_url}/v1/models", timeout=60), 401)
    assert httpx.post(url, json=body, headers=AUTH, timeout=60).status_code == 200
    client = openai.OpenAI(base_url=f"{guarded_url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [GUARDED]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded_url}/v1", api_key="bad", max_retries=0).models.list()


# -- overload, queue bound and disconnects (max_num_seqs=1) ---------------------------------
def long_body(max_tokens: int = 1500, stream: bool = False) -> dict:
    return {"model": GUARDED, "prompt": "abc", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "speculation": {"method": "none"}}


def test_burst_overload_gives_503_then_recovers(guarded_url):
    url = f"{guarded_url}/v1/completions"

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(url, json=long_body(400), headers=AUTH) for _ in range(12)))

    replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    busy = [r for r in replies if r.status_code in (503, 429)]
    assert busy and any(c == 200 for c in codes) and set(codes) <= {200, 429, 503}, codes
    for r in busy:
        assert_openai_error(r, r.status_code)
        assert r.json()["error"]["type"] == "overloaded" and int(r.headers["retry-after"]) >= 1
    for r in replies:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 400
    ok = httpx.post(url, json=long_body(5), headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5


def test_engine_queue_bound(guarded_url):
    """One running + one waiting fills this replica (max_waiting_sequences=1): a third is 503
    at once, with Retry-After, although Serve would let up to max_ongoing_requests=4 reach the replica."""
    url = f"{guarded_url}/v1/completions"

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", url, json=long_body(stream=True), headers=AUTH) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                async for line in lines:  # first token: it holds the only slot
                    if line.startswith("data: "):
                        break
                waiting = asyncio.create_task(c.post(url, json=long_body(4), headers=AUTH))
                await asyncio.sleep(1.0)
                assert not waiting.done()
                third = await c.post(url, json=long_body(4), headers=AUTH)
                await running.aclose()  # frees the slot: the waiting request runs
            return third, await waiting

    third, waiting = asyncio.run(scenario())
    assert_openai_error(third, 503)
    assert third.json()["error"]["type"] == "overloaded" and third.headers["retry-after"] == "1"
    assert waiting.status_code == 200 and waiting.json()["usage"]["completion_tokens"] == 4


def test_disconnect_mid_stream_frees_the_sequence(guarded_url):
    url = f"{guarded_url}/v1/completions"
    start = time.monotonic()
    r = httpx.post(url, json=long_body(400), headers=AUTH, timeout=120)
    full_400 = time.monotonic() - start
    assert r.status_code == 200
    # Each long stream (1500 tokens, ~4x the request above) is dropped after one chunk;
    # were its sequence kept, the next stream could not start until it ended.
    start = time.monotonic()
    for _ in range(4):
        with httpx.stream("POST", url, json=long_body(stream=True), headers=AUTH, timeout=120) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: "):
                    break
    t0 = time.monotonic()
    after = httpx.post(url, json=long_body(3), headers=AUTH, timeout=120)
    follow_up = time.monotonic() - t0
    dropped = t0 - start
    print(f"\n400 tokens: {full_400:.2f}s; 4 dropped 1500-token streams: {dropped:.2f}s; follow-up: {follow_up:.2f}s")
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    # Unfreed, the four streams would have cost ~4 x 1500 tokens (~15 x full_400).
    assert dropped < 4 * full_400 + 4, (dropped, full_400)
    assert follow_up < full_400 + 2, (follow_up, full_400)

    # A non-streamed request whose client gives up (read timeout) is freed as well.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=long_body(4000), headers=AUTH, timeout=httpx.Timeout(60, read=0.5))
    t0 = time.monotonic()
    after = httpx.post(url, json=long_body(3), headers=AUTH, timeout=120)
    assert after.status_code == 200 and time.monotonic() - t0 < full_400 + 2, (time.monotonic() - t0, full_400)


# -- /metrics --------------------------------------------------------------------------------
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")


def metric_sums(text: str, model: str) -> dict[str, float]:
    """Sum of each series over its label sets, for one model ('_total' suffix dropped)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m or f'model="{model}"' not in (m.group(2) or ""):
            continue
        name = m.group(1)
        name = name[: -len("_total")] if name.endswith("_total") else name
        sums[name] = sums.get(name, 0.0) + float(m.group(3))
    return sums


def test_metrics_match_responses(guarded_url):
    """The counters grow by what the responses report (other tests' requests counted before)."""
    url = f"{guarded_url}/v1/completions"
    before = metric_sums(httpx.get(f"{guarded_url}/metrics", timeout=30).text, GUARDED)
    expected = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for prompt, method in (("abcabcabcabc", "ngram"), ("helloWorld", "draft"), ("xyxyxyxy", "draft")):
        body = {"model": GUARDED, "prompt": prompt, "max_tokens": 32, "temperature": 0,
                "speculation": {"method": method, "num_speculative_tokens": 3}}
        r = httpx.post(url, json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200
        for m in r.json()["speculation_metrics"]:
            for key in expected:
                expected[key] += m[key]
    assert expected["num_drafts"] > 0
    names = {f"ray_specray_spec_decode_{k}": v for k, v in expected.items()}
    deadline = time.monotonic() + 45
    while True:
        text = httpx.get(f"{guarded_url}/metrics", timeout=30).text
        sums = metric_sums(text, GUARDED)
        sums = {n: v - before.get(n, 0) for n, v in sums.items()}
        if all(sums.get(n, 0) == v for n, v in names.items()) and sums.get("ray_specray_spec_decode_budget_steps", 0) > 0:
            break
        assert time.monotonic() < deadline, (names, {n: sums.get(n) for n in names})
        time.sleep(1)
    assert sums.get("ray_specray_request_success", 0) >= 3
    assert sums.get("ray_specray_generation_tokens", 0) >= 96
    for hist in ("ray_specray_time_to_first_token_seconds", "ray_specray_inter_token_latency_seconds"):
        assert sums.get(f"{hist}_count", 0) > 0 and f"{hist}_bucket" in sums, hist
    if expected["num_accepted_tokens"]:
        assert sums["ray_specray_spec_decode_num_accepted_tokens_per_pos"] == expected["num_accepted_tokens"]
    assert "ray_specray_spec_decode_num_drafts_total" in text  # counters carry Prometheus' _total (README names)


def test_load_gauges_count_a_running_request_and_fall_to_zero_when_idle(guarded_url):
    """ray_specray_num_requests_running is 1 while a request runs and 0 once it is done (it
    once stayed at 1 on an idle server: the last value was set before the request left)."""
    from concurrent.futures import ThreadPoolExecutor

    def gauges() -> tuple[float | None, float | None]:
        sums = metric_sums(httpx.get(f"{guarded_url}/metrics", timeout=30).text, GUARDED)
        return sums.get("ray_specray_num_requests_running"), sums.get("ray_specray_num_requests_waiting")

    body = {"model": GUARDED, "prompt": "abc", "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "speculation": {"method": "none"}}
    # Ray exports gauges every few seconds: requests run one after another until an export
    # falls inside one (a readiness wait, however fast or slow this machine is).
    seen, deadline = set(), time.monotonic() + 300
    with ThreadPoolExecutor(1) as pool:
        while 1 not in seen and time.monotonic() < deadline:
            reply = pool.submit(httpx.post, f"{guarded_url}/v1/completions", json=body, headers=AUTH, timeout=240)
            while not reply.done() and 1 not in seen:
                seen.add(gauges()[0])
                time.sleep(0.5)
            assert reply.result().status_code == 200
    assert 1 in seen, seen
    deadline = time.monotonic() + 45
    while gauges() != (0, 0):
        assert time.monotonic() < deadline, gauges()
        time.sleep(1)


# -- the demo pair (real tokenizer, chat template) ------------------------------------------
@pytest.fixture(scope="module")
def demo_client(demo_url):
    return openai.OpenAI(base_url=f"{demo_url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def demo_reference(demo_models):
    """Greedy text of the in-process engine (lossless plain decoding) for a prompt."""
    import copy

    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine
    from specray.engine.params import SamplingParams, SpeculationParams

    target, draft, tok = demo_models
    engine = LLMEngine(EngineConfig(target="<in-memory>", max_num_seqs=2), target_model=copy.deepcopy(target),
                       draft_model=copy.deepcopy(draft), tokenizer=tok)

    def reference(prompt: str, max_tokens: int):
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0)
        return engine.generate([prompt], sampling, SpeculationParams(method="none"))[0]

    return reference


@pytest.mark.slow
def test_demo_completion_greedy_matches_engine(demo_client, demo_reference, demo_models):
    prompt = "def fibonacci(n):\n    "
    ref = demo_reference(prompt, 40)
    tok = demo_models[2]
    hf = hf_greedy(demo_models[0], tok.encode(prompt, add_special_tokens=False), 40)
    assert ref.token_ids[: len(hf)] == hf[: len(ref.token_ids)]
    for method in ("none", "draft", "ngram"):
        r = demo_client.completions.create(
            model="specray-demo", prompt=prompt, max_tokens=40, temperature=0,
            extra_body={"speculation": {"method": method, "num_speculative_tokens": 3}},
        )
        assert r.choices[0].text == ref.text, method
        assert r.usage.completion_tokens == len(ref.token_ids)
        if method != "none":
            assert r.model_dump()["speculation_metrics"][0]["num_drafts"] > 0


@pytest.mark.slow
def test_demo_chat_and_stream(demo_client, demo_reference, demo_models):
    tok = demo_models[2]
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = demo_reference(prompt, 24)
    r = demo_client.chat.completions.create(
        model="specray-demo", messages=messages, max_tokens=24, temperature=0,
        extra_body={"speculation": {"method": "draft", "num_speculative_tokens": 3}},
    )
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ("stop" if ref.finish_reason == "stop" else "length")
    pieces = [c.choices[0].delta.content or "" for c in demo_client.chat.completions.create(
        model="specray-demo", messages=messages, max_tokens=24, temperature=0, stream=True,
        extra_body={"speculation": {"method": "ngram"}}) if c.choices]
    assert "".join(pieces) == ref.text and len([p for p in pieces if p]) >= 2


# -- tool calls on the demo pair (auto tool choice on, hermes; tests/test_tools.py: the rest) --------
def valid_call(call) -> dict:
    """A call of the openai client's reply: its id and type, its arguments valid for its tool."""
    from tests.test_tools import SCHEMAS

    assert call.id.startswith("call_") and call.type == "function"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.slow
def test_required_and_named_tool_calls(demo_client):
    """required with parallel_tool_calls false: exactly one call; a named function: that one;
    the stream, assembled by the client, is the same reply; with parallel calls allowed the
    demo model writes several (until max_tokens: no valid whole array, so the reply is its text)."""
    from tests.test_tools import ASK, TIME, WEATHER

    one = demo_client.chat.completions.create(model=DEMO, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    valid_call(call)
    named = demo_client.chat.completions.create(model=DEMO, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                temperature=0, extra_body={"speculation": {"method": "ngram"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(valid_call(call)) == {"city", "unit"}
    assert named.choices[0].finish_reason == "tool_calls"
    with demo_client.chat.completions.stream(model=DEMO, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=60, temperature=0) as stream:
        pieces = [event for event in stream if event.type == "tool_calls.function.arguments.delta"]
        streamed = stream.get_final_completion().choices[0]
    assert len(pieces) >= 2 and streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    several = demo_client.chat.completions.create(model=DEMO, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                                  max_tokens=60, temperature=0, stream=True)
    indices = {tc.index for chunk in several if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []}
    assert len(indices) >= 2


@pytest.mark.slow
def test_a_tool_result_round_trips(demo_client):
    """The call goes back as the assistant's tool_calls, its result as a tool message; the chat
    template renders both (the prompt grows by them) and the model answers."""
    from tests.test_tools import ASK, WEATHER

    first = demo_client.chat.completions.create(model=DEMO, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = demo_client.chat.completions.create(model=DEMO, messages=messages, tools=[WEATHER], tool_choice="none",
                                                 max_tokens=8, temperature=0)
    assert isinstance(second.choices[0].message.content, str) and not second.choices[0].message.tool_calls
    grown = second.usage.prompt_tokens - first.usage.prompt_tokens
    assert grown > len(call.function.arguments) // 4, grown


HERMES_CALL = r'Checking\.\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}\n</tool_call>'


@pytest.mark.slow
def test_auto_tool_choice_parses_what_the_model_writes(demo_client, demo_url):
    """auto (the default with tools) on a server started with --enable-auto-tool-choice
    --tool-call-parser hermes: a Hermes call the model writes (a regex makes the demo model write
    one) comes back as tool_calls, its text before as content — whole and streamed; the bad
    requests are 400s naming their field."""
    from tests.test_tools import ASK, TIME, assemble, chat

    extra = {"structured_outputs": {"regex": HERMES_CALL}}
    whole = demo_client.chat.completions.create(model=DEMO, messages=ASK, tools=[TIME], max_tokens=80, temperature=0,
                                                extra_body=extra)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and len(valid_call(call)["zone"]) == 3
    chunks = [c for c in demo_client.chat.completions.create(model=DEMO, messages=ASK, tools=[TIME], max_tokens=80,
                                                             temperature=0, extra_body=extra, stream=True) if c.choices]
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks]
    content, calls = assemble(deltas)
    assert content == "Checking." and [(c["name"], c["arguments"]) for c in calls] == \
        [(call.function.name, call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    url = f"{demo_url}/v1/chat/completions"
    for patch, param in ((dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                         (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]),
                          "tools.0.function.parameters")):
        err = assert_openai_error(httpx.post(url, json=chat(**patch), timeout=60), 400)
        assert err["param"] == param, err


@pytest.mark.slow
def test_structured_outputs_over_http(demo_client, demo_url, demo_reference):
    """The openai client's structured calls on the demo pair: ``parse()`` with a pydantic model
    (response_format json_schema, strict), json_object, vLLM's structured_outputs and guided_*
    choice and regex; each output matches, whatever the method; a bad schema is a 400 and the
    server serves the next request."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        kind: Literal["function", "class", "loop"]
        valid: bool

    messages = [{"role": "user", "content": "What is `def f(x): return x`? Answer in JSON."}]
    for spec in ({"method": "draft", "num_speculative_tokens": 3}, {"method": "ngram"}):
        done = demo_client.beta.chat.completions.parse(model=DEMO, messages=messages, response_format=Verdict,
                                                       max_tokens=40, temperature=0, extra_body={"speculation": spec})
        assert isinstance(done.choices[0].message.parsed, Verdict), done
        assert done.choices[0].finish_reason == "stop"
    obj = demo_client.chat.completions.create(model=DEMO, messages=messages, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert text.startswith("{") and (obj.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    prompt = "def add(a, b):\n    return"
    for extra, check in (({"structured_outputs": {"choice": ["a + b", "a - b", "b"]}}, lambda t: t in ("a + b", "a - b", "b")),
                         ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": " [a-z]{1,3}( [+*-] [a-z]{1,3})?"}, re.compile(r" [a-z]{1,3}( [+*-] [a-z]{1,3})?").fullmatch),
                         ({"structured_outputs": {"regex": "[0-9]{4}"}, "n": 2, "temperature": 0.8, "seed": 1},
                          re.compile("[0-9]{4}").fullmatch)):
        r = demo_client.completions.create(model=DEMO, prompt=prompt, max_tokens=16,
                                           **({"temperature": 0} | {k: v for k, v in extra.items() if k in ("n", "temperature", "seed")}),
                                           extra_body={k: v for k, v in extra.items() if k not in ("n", "temperature", "seed")})
        for c in r.choices:
            assert check(c.text), (extra, c.text)
    bad = httpx.post(f"{demo_url}/v1/completions", json={"model": DEMO, "prompt": prompt, "guided_regex": "[a-"},
                     timeout=60)
    assert_openai_error(bad, 400, "invalid regex")
    assert bad.json()["error"]["param"] == "guided_regex"
    plain = demo_client.completions.create(model=DEMO, prompt=prompt, max_tokens=8, temperature=0)
    assert plain.choices[0].text == demo_reference(prompt, 8).text


# -- OpenAI conventions: prompt forms, errors, logprobs, echo --------------------------------------
def test_a_long_prompt_list_runs_whole_and_past_the_limit_is_a_400(main_url, target_model):
    """500 prompts in one request are queued and run (not 503 from Serve's queue bound:
    the request is one call); prompts x n past max_sequences_per_request (600 here) is a 400
    naming the limit."""
    url = f"{main_url}/v1/completions"
    prompts = [[i % 64, i // 64 + 1] for i in range(500)]
    body = {"model": MAIN, "prompt": prompts, "max_tokens": 2, "temperature": 0, "speculation": {"method": "none"}}
    r = httpx.post(url, json=body, timeout=240)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(500)) and r.json()["usage"]["completion_tokens"] == 1000
    for i in (0, 137, 499):
        assert choices[i]["text"] == greedy_text(target_model, prompts[i], 2)
    err = assert_openai_error(httpx.post(url, json={**body, "prompt": prompts[:301], "n": 2}, timeout=60), 400,
                              "602 sequences", "max_sequences_per_request")
    assert err["param"] == "prompt"


def test_a_replica_whose_workers_cannot_start_says_why_and_never_retries(server, tiny_tok, tmp_path_factory):
    """Its coordinator gives back what it reserved and answers every request with the cause
    (the start-up warm-up stops on it): no placement-group retry loop, no 'ready'."""
    broken = tmp_path_factory.mktemp("no-head")  # no EAGLE head in it
    cfg = {"model_name": "broken", "engine": {**tiny_tok, "checkpoints": {"eagle": str(broken)},
                                              "placement": cpu_placement("colocated")}}
    def reserved() -> int:
        return sum(g["state"] == "CREATED" for g in ray.util.placement_group_table().values())

    before = reserved()
    serve.run(build_app(cfg), name="broken", route_prefix="/broken")
    try:
        url = f"{server}/broken/v1/completions"
        body = {"model": "broken", "prompt": "abc", "max_tokens": 2}
        for _ in range(2):
            start = time.monotonic()
            err = assert_openai_error(httpx.post(url, json=body, timeout=120), 500, "failed to start",
                                      "not an EAGLE head directory")
            assert err["type"] == "engine_start_failed"
        assert time.monotonic() - start < 5  # the second answer waits on nothing
        assert reserved() == before  # its placement group was given back
    finally:
        serve.delete("broken")


def test_every_prompt_form_is_its_own_choice(main_url, target_model):
    url = f"{main_url}/v1/completions"
    forms = {"text": "abcd", "texts": ["abcd", "xyz"], "ids": [1, 2, 3], "id lists": [[1, 2, 3], [4, 5], [9]]}
    for name, prompt in forms.items():
        prompts = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
        body = {"model": MAIN, "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2}
        r = httpx.post(url, json=body, timeout=60).json()
        assert [c["index"] for c in r["choices"]] == list(range(2 * len(prompts))), name
        for i, c in enumerate(r["choices"]):
            p = prompts[i // 2]
            assert c["text"] == greedy_text(target_model, encode(p) if isinstance(p, str) else p, 6), (name, i)
        sizes = [len(p) for p in prompts]  # one character per token
        assert r["usage"] == {"prompt_tokens": sum(sizes), "completion_tokens": 12 * len(prompts),
                              "total_tokens": sum(sizes) + 12 * len(prompts)}, name
    # the batched form evaluation harnesses send, streamed too
    body = {"model": MAIN, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    texts = {0: "", 1: ""}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: greedy_text(target_model, [1, 2, 3], 5), 1: greedy_text(target_model, [4, 5], 5)}


def test_the_whole_request_is_checked_at_once(main_url):
    body = {"model": MAIN, "prompt": [1, 2], "presence_penalty": 3, "logprobs": 99, "suffix": "x", "echo": [1],
            "speculation": {"method": "bogus"}}
    err = assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=body, timeout=60), 400,
                              "presence_penalty", "logprobs", "suffix", "echo", "bogus")
    assert err["param"] in ("presence_penalty", "logprobs", "suffix", "echo") and "Value error" not in err["message"]
    # semantic problems of several prompts and the speculation, all in one answer
    body = {"model": MAIN, "prompt": [[1, 64], [1] * 300], "speculation": {"method": "bogus"}}
    err = assert_openai_error(httpx.post(f"{main_url}/v1/completions", json=body, timeout=60), 400,
                              "prompt.0", "prompt.1", "bogus")
    assert err["param"] == "prompt"


def test_routing_errors_in_openai_shape(main_url):
    err = assert_openai_error(httpx.get(f"{main_url}/v1/completions", timeout=30), 405, "GET")
    assert err["param"] == "method"
    err = assert_openai_error(httpx.post(f"{main_url}/v1/embeddings", json={}, timeout=30), 404, "/v1/embeddings")
    assert err["param"] == "path"
    big = b'{"model": "tiny", "prompt": "' + b"a" * (33 * 2**20) + b'"}'
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", content=big, timeout=120), 413, "bytes")


def hf_logprobs(model, ids) -> "torch.Tensor":
    """[T, V] log-softmax of the target's logits at every position of ``ids`` (teacher-forced)."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against_hf(model, prompt, choice_lp, tokens, atol=1e-4):
    """Each reported logprob and its top alternatives equal the target's own distribution."""
    lp = hf_logprobs(model, list(prompt) + list(tokens))
    for j, (tok, reported, top) in enumerate(zip(tokens, choice_lp["token_logprobs"], choice_lp["top_logprobs"])):
        row = lp[len(prompt) - 1 + j]
        assert abs(reported - row[tok].item()) < atol, (j, reported, row[tok].item())
        best = row.topk(len(top))
        assert [encode(t)[0] for t in top] == best.indices.tolist()
        assert all(abs(v - b) < atol for v, b in zip(top.values(), best.values.tolist()))


def test_logprobs_equal_with_and_without_speculation(main_url, target_model):
    url = f"{main_url}/v1/completions"
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for temperature in (0, 0.8):  # greedy and sampled (each against the target's own distribution)
        seen = {}
        for spec in ({"method": "none"}, {"method": "draft", "num_speculative_tokens": 3},
                     {"method": "ngram"}, {"method": "medusa"}, {"method": "eagle", "dynamic_tree": True},
                     {"method": "draft_model", "parallel_drafting": True, "num_speculative_tokens": 4},  # PARD
                     {"method": "dflash", "num_speculative_tokens": 5}):
            body = {"model": MAIN, "prompt": prompt, "max_tokens": 16, "temperature": temperature, "seed": 7,
                    "logprobs": 3, "speculation": spec}
            c = httpx.post(url, json=body, timeout=60).json()["choices"][0]
            lp = c["logprobs"]
            tokens = encode(c["text"])
            assert len(lp["tokens"]) == len(tokens) == 16 and all(len(t) == 3 for t in lp["top_logprobs"])
            check_against_hf(target_model, prompt, lp, tokens)
            seen[spec["method"]] = (tokens, lp["token_logprobs"])
        if temperature == 0:  # the same tokens, the same numbers
            ref_tokens, ref_lp = seen["none"]
            for method, (tokens, lps) in seen.items():
                assert tokens == ref_tokens and max(abs(a - b) for a, b in zip(lps, ref_lp)) < 1e-4, method


def test_echo_with_logprobs_scores_the_prompt_as_hf(main_url, target_model):
    prompt = "helloWorld"
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 1}
    c = httpx.post(f"{main_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert c["text"].startswith(prompt) and len(c["text"]) == len(prompt) + 4
    lp = c["logprobs"]
    assert lp["tokens"] == list(c["text"]) and lp["text_offset"] == list(range(len(prompt) + 4))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(target_model, encode(c["text"]))
    for t in range(1, len(c["text"])):
        assert abs(lp["token_logprobs"][t] - ref[t - 1, encode(c["text"][t])[0]].item()) < 1e-4, t
    plain = {**body, "logprobs": None}  # echo alone: the prompt's text, no numbers
    c = httpx.post(f"{main_url}/v1/completions", json=plain, timeout=60).json()["choices"][0]
    assert c["text"].startswith(prompt) and c["logprobs"] is None


def test_prompt_scoring_with_max_tokens_0(main_url, target_model):
    """max_tokens 0 with echo and logprobs (vLLM's prompt scoring): the prompt and its scores,
    nothing generated, streamed or not; without echo, 0 is a 400."""
    url = f"{main_url}/v1/completions"
    prompt = "helloWorld"
    body = {"model": MAIN, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    r = httpx.post(url, json=body, timeout=60).json()
    (c,) = r["choices"]
    assert c["text"] == prompt and c["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}
    lp = c["logprobs"]
    assert lp["tokens"] == list(prompt) and lp["token_logprobs"][0] is None
    ref = hf_logprobs(target_model, encode(prompt))
    for t in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][t] - ref[t - 1, encode(prompt[t])[0]].item()) < 1e-4, t
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as resp:
        events = sse_events(resp.iter_lines())
    chunks = [ch for ev in events[:-1] for ch in ev["choices"]]
    assert "".join(ch["text"] for ch in chunks) == prompt
    assert [x for ch in chunks if ch["logprobs"] for x in ch["logprobs"]["token_logprobs"]] == lp["token_logprobs"]
    assert_openai_error(httpx.post(url, json={**body, "echo": False}, timeout=60), 400, "echo")
    chat = {"model": MAIN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    assert_openai_error(httpx.post(f"{main_url}/v1/chat/completions", json=chat, timeout=60), 400, "max_tokens")


def test_openai_message_shapes(main_url, client, target_model):
    """Text parts, an assistant's null content (with tool calls), a tool message, tools: the
    tiny template renders each message's content, so the prompt is known."""
    ref = greedy_text(target_model, encode("abchelloZZ"), 6)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "system", "content": [{"type": "text", "text": "abc"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "", "tool_call_id": "c1"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model=MAIN, messages=messages, tools=tools, tool_choice="none",
                                       max_tokens=6, temperature=0)
    assert r.choices[0].message.content == ref and not r.choices[0].message.tool_calls
    url = f"{main_url}/v1/chat/completions"
    auto = {"model": MAIN, "messages": messages, "tools": tools, "max_tokens": 6}  # auto, the default with tools
    err = assert_openai_error(httpx.post(url, json=auto, timeout=60), 400, "--enable-auto-tool-choice",
                              "--tool-call-parser")
    assert err["param"] == "tool_choice"
    image = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    err = assert_openai_error(httpx.post(url, json={"model": MAIN, "messages": [{"role": "user", "content": image}]},
                                         timeout=60), 400, "image_url", "text")
    assert err["param"] == "messages.0.content"
    err = assert_openai_error(httpx.post(url, json={"model": MAIN, "messages": [{"role": "user", "content": None}]},
                                         timeout=60), 400, "needs content")
    assert err["param"] == "messages.0.content"
    tool = {"model": MAIN, "messages": [{"role": "tool", "content": "x"}]}
    assert_openai_error(httpx.post(url, json=tool, timeout=60), 400, "tool_call_id")


def test_models_retrieve(main_url, client):
    card = client.models.retrieve(MAIN)
    assert card.id == MAIN and card.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    err = assert_openai_error(httpx.get(f"{main_url}/v1/models/org/gpt-17", timeout=60), 404, "gpt-17")
    assert err["param"] == "model"


def test_chat_logprobs_streamed_and_not(main_url, target_model):
    url = f"{main_url}/v1/chat/completions"
    body = {"model": MAIN, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "speculation": {"method": "draft", "num_speculative_tokens": 3}}
    c = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    content = c["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == c["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    ref = hf_logprobs(target_model, encode("helloZZ" + c["message"]["content"]))
    for j, e in enumerate(content):
        assert abs(e["logprob"] - ref[6 + j, encode(e["token"])[0]].item()) < 1e-4
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        events = sse_events(r.iter_lines())
    streamed = [e for ev in events[:-1] for ch in ev["choices"] for e in ((ch.get("logprobs") or {}).get("content") or [])]
    assert [(e["token"], round(e["logprob"], 5)) for e in streamed] == \
        [(e["token"], round(e["logprob"], 5)) for e in content]
    assert_openai_error(httpx.post(url, json={**body, "logprobs": False}, timeout=60), 400, "top_logprobs")


def test_the_verification_budget_is_shown_over_http(main_url):
    """GET /v1/speculation: the replica's cost table (profiled at start-up), its last decision
    and how many slots it admitted over how many steps."""
    body = {"model": MAIN, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
    assert httpx.post(f"{main_url}/v1/completions", json=body, timeout=120).status_code == 200
    status = httpx.get(f"{main_url}/v1/speculation", timeout=60).json()
    assert status["policy"] == "budget" and status["totals"]["steps"] > 0, status
    assert status["costs"]["verify"] and status["last"] is not None, status


def test_client_errors_are_one_line_in_the_log(main_url):
    """A bad request leaves one line in the ingress replica's log, and no traceback anywhere in
    the application's replica logs (the engine's refusals travel as values)."""
    import pathlib

    marker = "frobnicate-" + str(time.time_ns())
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json={"model": MAIN, "prompt": [1], marker: 1},
                                   timeout=60), 400)
    assert_openai_error(httpx.post(f"{main_url}/v1/completions", json={"model": MAIN, "prompt": [1] * 300},
                                   timeout=60), 400)  # refused after parsing (the context)
    # A playground page load on a server without online learning: the listing says so (the page
    # then never asks for drafters), and asking anyway is a 404 answered by the ingress.
    assert httpx.get(f"{main_url}/playground/methods", timeout=60).json()["online_learning"] is False
    assert_openai_error(httpx.get(f"{main_url}/v1/drafters", timeout=60), 404, "online learning is off")
    logs = pathlib.Path(ray._private.worker._global_node.get_session_dir_path()) / "logs" / "serve"
    deadline = time.monotonic() + 20
    while True:
        text = "\n".join(p.read_text(errors="replace") for p in logs.glob("replica_main_*.log"))
        lines = [ln for ln in text.splitlines() if marker in ln]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(lines) == 1 and "client error 400" in lines[0], lines
    assert "Traceback" not in text
    assert not [ln for ln in text.splitlines() if "drafters" in ln and "ERROR" in ln]


def test_a_deterministic_failure_is_a_500_with_its_message_and_the_server_goes_on(main_url, target_model):
    """A request whose proposer raises (the toy method of tests/failing_method.py, registered
    in the replicas and their workers through the runtime environment; in this layout it
    drafts in a worker of its own) fails alone: 500 with the message (not 503 "retry":
    retrying cannot help), streamed or not; the next request, of the same method, is served."""
    from tests.failing_method import NAME, poisoned

    body = {"model": MAIN, "prompt": poisoned("propose"), "max_tokens": 8, "temperature": 0,
            "speculation": {"method": NAME, "num_speculative_tokens": 3}}
    r = httpx.post(f"{main_url}/v1/completions", json=body, timeout=60)
    assert_openai_error(r, 500, "internal error", "poisoned row in propose")
    with httpx.stream("POST", f"{main_url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = sse_events(s.iter_lines())
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["code"] == 500 and "poisoned row in propose" in errors[0]["message"], events
    ok = httpx.post(f"{main_url}/v1/completions", json={**body, "prompt": [1, 2, 3]}, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == greedy_text(target_model, [1, 2, 3], 8)


def test_drafter_versions_over_http(server, tiny_tok, main_url):
    """Online learning's endpoints: status, the learning switch, bad actions and arguments as
    OpenAI-shaped 400s; responses name the drafter version; a server without it says so."""
    cfg = {"model_name": "learning",
           "engine": {**tiny_tok, "max_num_seqs": 2, "placement": cpu_placement("colocated"),
                      "online_learning": {"enabled": True, "learn": False, "name": "test-online-http"}}}
    serve.run(build_app(cfg), name="learning", route_prefix="/learning")
    url = f"{server}/learning"
    try:
        wait_until_serving(url, "learning")
        r = httpx.post(f"{url}/v1/completions", json={"model": "learning", "prompt": "abcab", "max_tokens": 6,
                                                      "temperature": 0, "speculation": {"method": "draft"}}, timeout=60)
        assert r.json()["speculation_metrics"][0]["drafter_version"] == "draft@base"
        status = httpx.get(f"{url}/v1/drafters", timeout=60).json()
        assert status["learning"] == "off" and status["replica"]["serving"]["draft"] == "draft@base"
        assert_openai_error(httpx.post(f"{url}/v1/drafters/pin", json={}, timeout=60), 400, "missing method")
        assert_openai_error(httpx.post(f"{url}/v1/drafters/frobnicate", json={}, timeout=60), 400, "unknown")
        assert_openai_error(httpx.post(f"{url}/v1/drafters/load", json={"method": "draft", "path": "/nope"},
                                       timeout=60), 400, "no such directory")
        assert_openai_error(httpx.post(f"{url}/v1/drafters/learning", content=b"[", timeout=60), 400, "JSON")
        assert httpx.post(f"{url}/v1/drafters/learning", json={"enabled": True}, timeout=60).json() == {"learning": True}
        assert_openai_error(httpx.get(f"{main_url}/v1/drafters", timeout=60), 404, "online learning is off")
    finally:
        serve.delete("learning")
        from specray.actors.learner import OnlineLearningConfig, drop_learner

        drop_learner(OnlineLearningConfig(name="test-online-http"), "")


def test_a_small_kv_pool_refuses_what_never_fits_and_finishes_a_burst(server, tiny_tok, target_model):
    """Paged KV over HTTP: a pool of 8 blocks of 4 tokens (32 tokens). A prompt that can
    never fit is a 400 naming the numbers; a burst of 16 requests needing ~5 blocks each (10x
    the pool) all finish, 200, each equal to the target's greedy output (requests are
    preempted and recomputed, never failed); the metrics count preemptions."""
    name = "tiny-paged"
    cfg = {"model_name": name, "engine": {**tiny_tok, "max_num_seqs": 8, "block_size": 4, "num_gpu_blocks_override": 8,
                                          "placement": cpu_placement("colocated")},
           "max_ongoing_requests": 32}
    serve.run(build_app(cfg), name="paged", route_prefix="/paged")
    url = f"{server}/paged"
    try:
        wait_until_serving(url, name)
        r = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": [1] * 40, "max_tokens": 4}, timeout=60)
        assert_openai_error(r, 400, "40 tokens", "32 tokens")
        prompts = [[(i + j) % 60 + 1 for j in range(6 + i % 5)] for i in range(16)]

        async def burst():
            async with httpx.AsyncClient(timeout=300) as c:
                return await asyncio.gather(*(c.post(f"{url}/v1/completions", json={
                    "model": name, "prompt": p, "max_tokens": 12, "temperature": 0,
                    "speculation": {"method": "draft", "num_speculative_tokens": 3}}) for p in prompts))

        replies = asyncio.run(burst())
        assert [r.status_code for r in replies] == [200] * 16, [r.text for r in replies if r.status_code != 200]
        for p, r in zip(prompts, replies):
            assert r.json()["choices"][0]["text"] == greedy_text(target_model, p, 12)
        deadline = time.monotonic() + 30
        while "specray_num_preemptions_total" not in httpx.get(f"{url}/metrics", timeout=30).text:
            assert time.monotonic() < deadline, "no preemption counted"
            time.sleep(1)
    finally:
        serve.delete("paged")
