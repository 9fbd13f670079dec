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
    ("a user message without content", True, {"messages": [{"role": "user", "content": None}]},
     "messages.0.content", ["needs content"]),
    ("a tool message without its call", True, {"messages": [{"role": "tool", "content": "x"}]},
     "messages.0.tool_call_id", ["tool_call_id"]),
    ("tool calls of a user", True, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages.0.tool_calls", ["assistant"]),
    ("an image part", True, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", ["'image_url'", "text"]),
    ("top_logprobs without logprobs", True, {"top_logprobs": 2}, "top_logprobs", ["needs logprobs"]),
    ("continue the final message and add a prompt", True, {"continue_final_message": True},
     "continue_final_message", ["add_generation_prompt"]),
    ("stream options without a stream", False, {"stream_options": {"include_usage": True}}, "stream_options",
     ["stream is true"]),
    ("stream options on a chat without a stream", True, {"stream_options": {}, "stream": False}, "stream_options",
     ["stream is true"]),
    ("two structured outputs", False, {"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}},
     "guided_regex", ["one structured output", "structured_outputs"]),
    ("two kinds in structured_outputs", False, {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", ["exactly one", "regex, choice"]),
    ("an empty choice", False, {"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["at least 1"]),
    ("an empty guided choice", True, {"guided_choice": []}, "guided_choice", ["at least 1"]),
    ("a json_schema format without its schema", True, {"response_format": {"type": "json_schema"}},
     "response_format.json_schema", ["json_schema"]),
    ("an unknown response format", True, {"response_format": {"type": "yaml"}}, "response_format.type",
     ["text", "json_schema"]),
    ("another grammar backend", False, {"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend", ["llguidance"]),
    ("a whitespace pattern", False, {"guided_whitespace_pattern": " +"}, "guided_whitespace_pattern",
     ["not supported"]),
    ("an unknown structured output", False, {"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml",
     ["Extra inputs"]),
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


def test_null_is_the_default():
    req = C.parse(body(False, {"temperature": None, "top_p": None, "n": None, "stream": None, "max_tokens": None,
                               "presence_penalty": None, "logprobs": None, "min_tokens": None}), False)
    assert (req.temperature, req.top_p, req.n, req.stream, req.max_tokens, req.min_tokens) == (1.0, 1.0, 1, False,
                                                                                                 None, 0)
    with pytest.raises(C.RequestError) as info:
        C.parse({"model": None, "prompt": "x"}, False)
    assert info.value.param == "model"


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
    assert rendered(facts, messages=messages, tools=tools, tool_choice="none") == "Tfua\nbaCf7trIc1ZZ"
    assert rendered(facts, messages=messages[:1]) == "ua\nbZZ"  # no tools: none rendered


def test_a_template_that_fails_is_a_400_naming_messages(facts):
    with pytest.raises(C.RequestError) as info:
        rendered(facts, messages=[{"role": "assistant", "content": "x"}])
    assert info.value.param == "messages" and "starts with a user" in str(info.value)


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_choice_without_tools_is_refused(choice):
    with pytest.raises(C.RequestError) as info:
        C.parse(body(True, {"tool_choice": choice}), True)
    assert info.value.param == "tool_choice"


# -- vLLM's request fields ----------------------------------------------------------------
HONOURED = {  # vLLM's sampling and stream extensions specray honours, with a value each
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5,
    "min_tokens": 2, "stop_token_ids": [3], "ignore_eos": True, "include_stop_str_in_output": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "allowed_token_ids": [1, 2, 3],
    "logit_bias": {"7": -3.5}, "add_special_tokens": True, "truncate_prompt_tokens": 4,
    "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}
CHAT_HONOURED = {"add_generation_prompt": False, "continue_final_message": True, "chat_template": "{{ x }}",
                 "chat_template_kwargs": {"x": 1}, "documents": [{"title": "t", "text": "x"}]}
IGNORED = {  # the rest of vLLM's list: accepted, named once in the log
    "use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1, "bad_words": ["x"],
    "priority": 3,
    "request_id": "r", "logits_processors": ["m.P"], "return_tokens_as_token_ids": True, "cache_salt": "s",
    "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {"a": 1},
}
CHAT_IGNORED = {"echo": True, "include_reasoning": False, "reasoning_effort": "low", "best_of": 2}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_vllm_fields_are_accepted_and_the_ignored_named_once(chat, monkeypatch, caplog):
    from specray.protocol import openai as P

    monkeypatch.setattr(P, "_named", set())
    fields = {**HONOURED, **IGNORED, **(CHAT_HONOURED | CHAT_IGNORED if chat else {"prompt_embeds": "AAAA"})}
    with caplog.at_level("WARNING", logger="specray.protocol"):
        for _ in range(2):
            C.parse(body(chat, fields), chat)
    named = [r.getMessage().split("'")[1] for r in caplog.records]
    assert sorted(named) == sorted([*IGNORED, *(CHAT_IGNORED if chat else ["prompt_embeds"])])  # each once
    caplog.clear()
    with caplog.at_level("WARNING", logger="specray.protocol"):
        C.parse(body(chat, {"priority": 0, "use_beam_search": False}), chat)  # vLLM's defaults: nothing to say
    assert not caplog.records
    with pytest.raises(C.RequestError) as info:  # neither OpenAI's nor vLLM's
        C.parse(body(chat, {"guided_jsn": {}}), chat)
    assert info.value.param == "guided_jsn" and "Extra inputs" in str(info.value)


def test_vllm_sampling_fields_reach_the_engine():
    req = C.parse(body(False, {**HONOURED, "max_tokens": 8}), False)
    s = req.sampling(8)
    assert (s.top_k, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_tokens) == \
        (5, 0.1, 1.2, 0.5, -0.5, 2)
    assert s.stop_token_ids == [3] and s.ignore_eos and s.allowed_token_ids == [1, 2, 3] and s.logit_bias == {7: -3.5}
    assert s.include_stop_str_in_output and not s.skip_special_tokens and not s.spaces_between_special_tokens
    assert s.processes_logits and not C.parse(body(False, {}), False).sampling(8).processes_logits


@pytest.mark.parametrize("patch, param", [
    ({"logit_bias": {"64": 1}}, "logit_bias"), ({"allowed_token_ids": [0, 99]}, "allowed_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"allowed_token_ids": []},
                                                                                     "allowed_token_ids"),
])
def test_bad_extension_values_are_400s_naming_them(facts, patch, param):
    with pytest.raises(C.RequestError) as info:
        C.check(C.parse(body(False, patch), False), False, facts, 16)
    assert info.value.param == param, info.value.problems


# -- structured outputs --------------------------------------------------------------------
TAG = {"structures": [{"begin": "ab", "schema": {"type": "integer"}, "end": "z"}], "triggers": ["a"]}

@pytest.mark.parametrize("chat, patch, kind, value", [
    (True, {"response_format": {"type": "json_object"}}, "json_object", True),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "P", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}}, "json", {"type": "object", "properties": {
            "a": {"type": "integer"}}}),
    (False, {"structured_outputs": {"regex": "[a-c]+"}}, "regex", "[a-c]+"),
    (False, {"structured_outputs": {"grammar": 'start: "x" | "y"'}}, "grammar", 'start: "x" | "y"'),
    (False, {"guided_json": {"type": "string"}}, "json", {"type": "string"}),
    (True, {"guided_choice": ["yes", "no"], "guided_decoding_backend": "auto"}, "choice", ["yes", "no"]),
    (False, {"guided_regex": "a|b"}, "regex", "a|b"),
    (False, {"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    (False, {"structural_tag": json.dumps(TAG)}, "structural_tag", json.dumps(TAG)),
    (False, {"structured_outputs": {"structural_tag": TAG}}, "structural_tag", TAG),
])
def test_every_structured_output_shape_reaches_the_engine(facts, chat, patch, kind, value):
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields: each
    honoured (compiled at the check, before anything is queued), none ignored."""
    req = C.parse(body(chat, patch), chat)
    checked = C.check(req, chat, facts, 16)
    so = checked.samplings[0][0].structured_outputs
    assert (so.kind, so.value) == (kind, value)


@pytest.mark.parametrize("patch, param, words", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", ["invalid regex", "unclosed"]),
    ({"guided_json": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}}, "guided_json", ["invalid json"]),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", ["invalid grammar"]),
    ({"structural_tag": json.dumps({"structures": [{"begin": "ab", "end": "z"}], "triggers": ["x"]})}, "structural_tag",
     ["starts with none of the triggers"]),
    ({"structured_outputs": {"structural_tag": {"triggers": []}}}, "structured_outputs", ["invalid structural tag"]),
    ({"structured_outputs": {"regex": "[a-c]+"}, "allowed_token_ids": [25, 26]}, "allowed_token_ids",
     ["none of them can start"]),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(facts, patch, param, words):
    with pytest.raises(C.RequestError) as info:
        C.check(C.parse(body(False, patch), False), False, facts, 16)
    assert info.value.param == param, info.value.problems
    for word in words:
        assert word in str(info.value), str(info.value)
    assert "\n" not in json.dumps(str(info.value))  # one line


def test_special_tokens_and_truncation(tmp_path):
    """add_special_tokens as vLLM defaults it (completions add them, chat leaves them to the
    template), and truncate_prompt_tokens keeps the prompt's last tokens."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from specray.policies.registry import PlainOptions, Limits
    from tests.conftest import encode, save_char_tokenizer

    save_char_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="B $A", special_tokens=[("B", 27)])
    facts = C.Facts(tok, 256, 64, Limits(capacity=256, vocab_size=64, methods={"none": {}}), PlainOptions())

    def ids(chat, **patch):
        return C.check(C.parse(body(chat, patch), chat), chat, facts, 16).prompt_ids[0]

    assert ids(False, prompt="hello") == encode("Bhello")
    assert ids(False, prompt="hello", add_special_tokens=False) == encode("hello")
    assert ids(True) == encode("hiZZ") and ids(True, add_special_tokens=True) == encode("BhiZZ")
    checked = C.check(C.parse(body(False, {"prompt": "hello", "truncate_prompt_tokens": 3, "echo": True}), False),
                      False, facts, 16)
    assert checked.prompt_ids == [encode("llo")] and checked.prompts == [encode("llo")]


def test_chat_template_extensions(facts):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert rendered(facts, messages=messages, add_generation_prompt=False) == "uaab"
    assert rendered(facts, messages=messages, chat_template="{{ x }}{{ messages[0]['content'] }}",
                    chat_template_kwargs={"x": "q"}) == "qa"
    with pytest.raises(C.RequestError) as info:
        rendered(facts, messages=messages, continue_final_message=True)  # and add_generation_prompt (default)
    assert "continue_final_message" in str(info.value)
