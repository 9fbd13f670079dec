"""The one request check (``protocol/checks.py``) without a server: what the HTTP ingress and
batch files answer for a body, in milliseconds. ``tests/test_serve.py`` sends the same bodies
over HTTP (its ``ERRORS``) to show the answer's shape there."""

from __future__ import annotations

import json

import pytest

from specray.protocol import checks as C

ERRORS = [  # (id, chat, body patch, the error's param, words of its message)
    ("lone surrogate in a prompt", False, {"prompt": "a\ud800b"}, "prompt", ["Unicode", "\\ud800"]),
    ("lone surrogate in a prompt list", False, {"prompt": ["ok", "x\udc00"]}, "prompt.1", ["Unicode"]),
    ("lone surrogate in a message", True, {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content", ["Unicode"]),
    ("lone surrogate in a field name", False, {"\ud801": 1}, "\\ud801", ["field name"]),
    ("seed past int64", False, {"seed": 2**80}, "seed", ["seed", "9223372036854775807"]),
    ("seed below int64", False, {"seed": -(2**63) - 1}, "seed", ["seed"]),
    ("boolean max_tokens", False, {"max_tokens": True}, "max_tokens", ["valid integer"]),
    ("string max_tokens", False, {"max_tokens": "10"}, "max_tokens", ["valid integer"]),
    ("float max_tokens", False, {"max_tokens": 3.5}, "max_tokens", ["valid integer"]),
    ("string stream", False, {"stream": "yes"}, "stream", ["valid boolean"]),
    ("integer stream", True, {"stream": 1}, "stream", ["valid boolean"]),
    ("boolean temperature", False, {"temperature": True}, "temperature", ["valid number"]),
    ("boolean n", True, {"n": True}, "n", ["valid integer"]),
    ("boolean seed", False, {"seed": False}, "seed", ["valid integer"]),
    ("top_k past int64", False, {"top_k": 2**70}, "top_k", ["top_k"]),
]


def body(chat: bool, patch: dict) -> dict:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if chat else {"model": "m", "prompt": "hi"}
    return {**base, **patch}


@pytest.mark.parametrize("name, chat, patch, param, words", ERRORS, ids=[e[0] for e in ERRORS])
def test_a_bad_body_is_a_request_error_naming_its_param(name, chat, patch, param, words):
    with pytest.raises(C.RequestError) as info:
        C.parse(body(chat, patch), chat)
    assert info.value.param == param, info.value.problems
    for word in words:
        assert word in str(info.value), str(info.value)
    json.dumps(str(info.value)).encode("utf-8")  # the answer itself encodes


def test_the_extremes_that_are_valid_pass():
    for seed in (-(2**63), 2**63 - 1):
        assert C.parse(body(False, {"seed": seed}), False).seed == seed
    req = C.parse(body(False, {"temperature": 1, "top_p": 1}), False)  # integers where floats go
    assert req.temperature == 1.0 and req.top_p == 1.0


# -- OpenAI's chat shapes through a chat template -----------------------------------------
TOOL_TEMPLATE = (  # renders what a tool-aware template reads: tools, tool calls (arguments as an object), tool ids
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a conversation starts with a user') }}{% endif %}"
    "{% for t in tools or [] %}T{{ t['function']['name'] }}{% endfor %}"
    "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}C{{ c['function']['name'] }}{{ c['function']['arguments']['x'] }}{% endfor %}"
    "{% if m.get('tool_call_id') %}I{{ m['tool_call_id'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ZZ{% endif %}"
)


@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    from transformers import AutoTokenizer

    from specray.engine.params import best_speculation
    from specray.policies.registry import Limits
    from tests.conftest import save_char_tokenizer

    path = tmp_path_factory.mktemp("tool-tokenizer")
    save_char_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TOOL_TEMPLATE
    limits = Limits(capacity=256, vocab_size=64, methods={"none": {}})
    return C.Facts(tok, 256, 64, limits, best_speculation(limits.methods))


def rendered(facts, **patch) -> str:
    return C.check(C.parse(body(True, patch), True), True, facts, 16).prompts[0]


def test_tools_tool_calls_and_tool_messages_reach_the_template(facts):
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 7}'}}]},
                {"role": "tool", "content": "r", "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    assert rendered(facts, messages=messages, tools=tools) == "Tfua\nbaCf7trIc1ZZ"
    assert rendered(facts, messages=messages[:1]) == "ua\nbZZ"  # no tools: none rendered


def test_a_template_that_fails_is_a_400_naming_messages(facts):
    with pytest.raises(C.RequestError) as info:
        rendered(facts, messages=[{"role": "assistant", "content": "x"}])
    assert info.value.param == "messages" and "starts with a user" in str(info.value)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_tool_choice_that_needs_guided_decoding_is_refused(choice):
    with pytest.raises(C.RequestError) as info:
        C.parse(body(True, {"tool_choice": choice}), True)
    assert info.value.param == "tool_choice"
