"""Tool calling: the parsers on each family's format, the request checks, exactness under
speculation and batch files. Over HTTP (the shared demo server): tests/test_serve.py.

The demo models never saw tool data: ``auto`` is tested on outputs written in each family's
format (hermes: Qwen2.5/3 and Hermes; llama3_json: Llama 3.1/3.2), and over HTTP with a regex
that makes the model write a Hermes call; ``required`` and named calls run end to end.
"""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from specray.protocol import checks as C
from specray.protocol import tool_parsers as T
from specray.protocol import tools
from tests.serving import DEMO

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]

# -- the parsers, on each family's format ---------------------------------------------------------
PARIS = '{"city": "Paris", "unit": "celsius"}'
HERMES = {  # name -> (model output, content, calls)
    "single": ('<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + '}\n</tool_call>',
               None, [("get_weather", PARIS)]),
    "several": ('<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + '}\n</tool_call>\n<tool_call>\n'
                '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
                None, [("get_weather", PARIS), ("get_time", '{"zone": "CET"}')]),
    "text first": ('Let me look that up.\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
                   '</tool_call>', "Let me look that up.", [("get_time", '{"zone": "CET"}')]),
    "nested, braces in strings": ('<tool_call>\n{"name": "f", "arguments": {"q": "a } b {", "n": [1, {"m": null}]}}'
                                  '\n</tool_call>', None, [("f", '{"q": "a } b {", "n": [1, {"m": null}]}')]),
    "left open": ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None,
                  [("get_time", '{"zone": "UTC"}')]),
    "no call": ("It is sunny in Paris today.", "It is sunny in Paris today.", []),
    "malformed JSON": ('<tool_call>\n{"name": "get_time", "arguments": {"zone": UTC}}\n</tool_call>', None, []),
    "unfinished call": ('Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UT', None, []),
}
LLAMA = {
    "single": ('{"name": "get_weather", "parameters": ' + PARIS + '}', None, [("get_weather", PARIS)]),
    "python tag": ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', None,
                   [("get_time", '{"zone": "CET"}')]),
    "several": ('{"name": "get_weather", "parameters": ' + PARIS + '}; {"name": "get_time", "parameters": '
                '{"zone": "CET"}}', None, [("get_weather", PARIS), ("get_time", '{"zone": "CET"}')]),
    "text first": ('Checking.<|python_tag|>{"name": "get_time", "arguments": {"zone": "CET"}}', "Checking.",
                   [("get_time", '{"zone": "CET"}')]),
    "arguments as a string": ('{"name": "get_time", "parameters": "{\\"zone\\": \\"CET\\"}"}', None,
                              [("get_time", '{"zone": "CET"}')]),
    "no call": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "malformed JSON": ('{"name": "get_time", "parameters": {"zone": "CET"}', None, []),
    "JSON that is not a call": ('{"city": "Paris"}', None, []),
}
CASES = [("hermes", name, *case) for name, case in HERMES.items()] + [
    ("llama3_json", name, *case) for name, case in LLAMA.items()]


def assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a client makes of streamed deltas: the content, and each call by its index."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None and tc["type"] == "function" and tc["function"]["arguments"] == ""
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("parser, name, text, content, calls", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_a_reply_is_parsed_whole_and_streamed_alike(parser, name, text, content, calls):
    """A call that does not parse leaves the whole text as content; streamed deltas, fed a
    character at a time or in chunks, add up to the whole reply's content and calls. A stream
    cannot take back a call it has named: where the call breaks after its name went out, the
    stream keeps that call and sends no more (the whole reply is the text)."""
    parsed = T.parse(T.FORMATS[parser], text)
    assert parsed.calls == calls
    assert parsed.content == (content if calls else text)
    for step in (1, 7, len(text)):
        stream, deltas = T.CallStream(T.FORMATS[parser]), []
        for end in list(range(step, len(text), step)) + [len(text)]:
            deltas += stream.feed(text[:end], final=end == len(text))
        streamed, streamed_calls = assemble(deltas)
        assert all(c["id"].startswith("call_") for c in streamed_calls) and stream.called == bool(streamed_calls)
        if not calls and streamed_calls:  # broken after its name was sent
            assert [c["name"] for c in streamed_calls] == ["get_time"] and text.startswith(streamed), step
            continue
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == calls, step
        assert streamed == (parsed.content or ""), step


def test_a_call_is_sent_name_first_then_arguments_in_pieces():
    text = HERMES["text first"][0]
    stream = T.CallStream(T.FORMATS["hermes"])
    deltas = [d for end in range(1, len(text) + 1) for d in stream.feed(text[:end], end == len(text))]
    kinds = ["content" if "content" in d else "id" if "id" in d["tool_calls"][0] else "arguments" for d in deltas]
    first = kinds.index("id")
    assert set(kinds[:first]) == {"content"} and kinds.count("id") == 1
    assert kinds[first + 1:] == ["arguments"] * (len(kinds) - first - 1) and len(kinds) - first - 1 > 3


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_a_stream_reads_what_each_feed_adds_not_the_whole_reply_again(parser):
    """A feed resumes the scan where the last one stopped (the text only grows): streaming long
    calls a token (~4 characters) at a time reads each character a few times in all, where
    scanning the whole reply per feed reads it once per feed (~900 times here)."""
    reads = [0]

    class Counted(str):
        def __getitem__(self, key):
            reads[0] += 1
            return super().__getitem__(key)

    args = json.dumps({"code": "x = [1, {'a': 2}]\n" * 200, "n": 1})
    call = ('<tool_call>\n{"name": "write", "arguments": ' + args + '}\n</tool_call>' if parser == "hermes"
            else '{"name": "write", "parameters": ' + args + '}')
    text = "Sure.\n" + call if parser == "hermes" else call + "; " + call
    stream, deltas = T.CallStream(T.FORMATS[parser]), []
    for end in list(range(4, len(text), 4)) + [len(text)]:
        deltas += stream.feed(Counted(text[:end]), final=end == len(text))
    assert [(c["name"], c["arguments"]) for c in assemble(deltas)[1]] == T.parse(T.FORMATS[parser], text).calls
    assert reads[0] < 20 * len(text), reads[0] / len(text)


# -- the request ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_tokenizer(demo_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_pair.tokenizer)


def facts_of(tokenizer, parser=None) -> C.Facts:
    from specray.engine.params import best_speculation
    from specray.policies.registry import Limits

    limits = Limits(capacity=2048, vocab_size=len(tokenizer), methods={"none": {}})
    return C.Facts(tokenizer, 2048, len(tokenizer), limits, best_speculation(limits.methods), tool_parser=parser)


def chat(**patch) -> dict:
    return {"model": DEMO, "messages": ASK, "tools": [WEATHER, TIME], **patch}


BAD = [  # (name, patch, param, words)
    ("named function not among the tools", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", ["'nope' is not among the tools", "get_weather"]),
    ("required without tools", {"tools": None, "tool_choice": "required"}, "tool_choice", ["needs tools"]),
    ("empty tools", {"tools": []}, "tools", ["must not be empty"]),
    ("parameters not a schema", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}]}, "tools.0.function.parameters", ["not a valid JSON schema", "objekt"]),
    ("another structured output", {"tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", ["response_format", "one per request"]),
    ("an unknown choice", {"tool_choice": "always"}, "tool_choice", ["'always'", "required"]),
    ("a named choice without a name", {"tool_choice": {"type": "function", "function": {}}}, "tool_choice",
     ["function.name", "my_function"]),
]


@pytest.mark.parametrize("name, patch, param, words", BAD, ids=[b[0] for b in BAD])
def test_a_tool_request_the_server_cannot_honour_names_its_field(name, patch, param, words):
    body = {k: v for k, v in chat(**patch).items() if v is not None}
    with pytest.raises(C.RequestError) as info:
        C.parse(body, True)
    assert info.value.param == param and all(w in str(info.value) for w in words), str(info.value)


def test_tool_choice_decides_the_constraint_and_how_the_reply_is_read(demo_tokenizer):
    """auto is the default with tools and needs the server's parser (vLLM's 400 otherwise);
    required and named constrain the output to the call schema; none renders the tools only."""
    off, on = facts_of(demo_tokenizer), facts_of(demo_tokenizer, "hermes")
    with pytest.raises(C.RequestError) as info:
        C.check(C.parse(chat(), True), True, off, 16)
    assert info.value.param == "tool_choice" and str(info.value) == f"tool_choice: {tools.AUTO_NEEDS_FLAGS}"
    auto = C.check(C.parse(chat(), True), True, on, 16)
    assert auto.tools == tools.ToolPlan("auto", parser="hermes") and auto.samplings[0][0].structured_outputs is None
    none = C.check(C.parse(chat(tool_choice="none"), True), True, off, 16)
    assert none.tools is None and '"name": "get_time"' in none.prompts[0]  # rendered, never parsed
    required = C.check(C.parse(chat(tool_choice="required", parallel_tool_calls=False), True), True, off, 16)
    schema = required.samplings[0][0].structured_outputs.json_
    assert required.tools == tools.ToolPlan("required", parallel=False) and schema["maxItems"] == 1
    named = C.check(C.parse(chat(tool_choice={"type": "function", "function": {"name": "get_time"}}), True), True,
                    off, 16)
    assert named.tools.function == "get_time" and named.samplings[0][0].structured_outputs.json_ == SCHEMAS["get_time"]


@pytest.mark.parametrize("parallel, text, whole", [
    (True, '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": '
           '{"city": "Rome", "unit": "celsius"}}]', True),
    (False, '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name"', False),  # a second call refused
    (True, '[{"name": "get_date"', False),                                        # not a tool
    (True, '[{"name": "get_time", "parameters": {"zone": "CET", "x"', False),     # not in its schema
    (True, '[]', False),                                                          # at least one call
])
def test_the_call_schema_admits_exactly_calls_of_the_tools(demo_tokenizer, parallel, text, whole):
    from specray.engine.grammar import Grammars

    schema = tools.call_schema([(t["function"]["name"], t["function"]["parameters"]) for t in (WEATHER, TIME)],
                               None, parallel)
    grammars = Grammars(demo_tokenizer, len(demo_tokenizer), demo_tokenizer.eos_token_id)
    row = grammars.matcher(grammars.source("json", schema), frozenset())
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    assert (row.valid_prefix(ids) == len(ids)) == whole, text


def test_special_markers_stay_in_the_text_where_the_tokenizer_makes_them_special(demo_tokenizer):
    tok = copy.deepcopy(demo_tokenizer)
    assert not tools.ToolPlan("auto", parser="hermes").keeps_special_tokens(tools.special_tokens(tok))
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert tools.ToolPlan("auto", parser="hermes").keeps_special_tokens(tools.special_tokens(tok))
    checked = C.check(C.parse(chat(), True), True, facts_of(tok, "hermes"), 16)
    assert checked.samplings[0][0].skip_special_tokens is False


# -- exact under speculation, and in batch files (the demo pair, in this process) ---------------------
@pytest.mark.slow  # loads the demo pair's weights
def test_required_calls_are_the_same_tokens_under_every_method(demo_models, demo_tokenizer):
    """The constrained call is the grammar layer's: greedy, token for token the constrained
    target's (its forward per token, masked by llguidance's own matcher) for plain decoding, a
    draft model, prompt lookup and an EAGLE tree; it parses into calls whose arguments validate;
    a batch file's line with the same body answers with those calls."""
    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine
    from specray.engine.params import SpeculationParams
    from specray.entrypoints import openai_batch
    from tests.test_eagle import random_head
    from tests.test_structured import constrained_greedy

    target, draft, _ = demo_models
    # (the budget unprofiled: every method drafts from its first steps, whatever the machine's load)
    engine = LLMEngine(EngineConfig(target="<in-memory>", max_num_seqs=2, profile_costs=False),
                       target_model=copy.deepcopy(target), draft_model=copy.deepcopy(draft), tokenizer=demo_tokenizer,
                       resources={"eagle": random_head(target)})
    facts = facts_of(demo_tokenizer)
    body = chat(tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
    line, problems = openai_batch.check_line({"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
                                              "body": body}, facts)
    assert not problems
    ids, sampling = line.checked.prompt_ids, line.checked.samplings[0][0]
    outs = {m: engine.generate(ids, sampling, SpeculationParams(method=m))[0]
            for m in ("none", "draft", "ngram", "eagle")}
    assert len({tuple(o.token_ids) for o in outs.values()}) == 1, {m: o.text for m, o in outs.items()}
    plain = outs["none"]
    reference = constrained_greedy(target, demo_tokenizer, ids[0], {"json": sampling.structured_outputs.json_}, 60)
    assert plain.token_ids in (reference, reference + [demo_tokenizer.eos_token_id]) and plain.finish_reason == "stop"
    parsed = T.parse(T.scan_required, plain.text)
    assert len(parsed.calls) == 1 and parsed.content is None
    for name, arguments in parsed.calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert outs["draft"].metrics["num_draft_tokens"] > 0
    reply = json.loads(line.output_line([vars(plain)]))["response"]["body"]["choices"][0]
    assert reply["finish_reason"] == "tool_calls" and reply["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply["message"]["tool_calls"]] == \
        parsed.calls


# -- the flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--tool-call-parser", "mistral"], ["--tool-call-parser mistral", "hermes, llama3_json"]),
    (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice needs --tool-call-parser"]),
])
def test_serve_refuses_tool_flags_it_cannot_honour(argv, words, capsys):
    from specray.entrypoints.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_a_job_takes_the_tool_flags_over_its_configs_keys(tmp_path):
    """A job reads a serve config's enable-auto-tool-choice and tool-call-parser, and vLLM's
    flags, which override it; its engine part is the job's config as before."""
    from specray.entrypoints import jobs

    config = tmp_path / "serve.yaml"
    config.write_text("enable-auto-tool-choice: true\ntool-call-parser: llama3_json\nmax-num-seqs: 3\n")
    base = ["--input", "in.jsonl", "--output", "out.jsonl"]
    parse = jobs.build_parser().parse_args
    assert jobs.tool_settings(parse(base)) is None
    assert jobs.tool_settings(parse([*base, "--config", str(config)])) == "llama3_json"
    assert jobs.tool_settings(parse([*base, "--config", str(config), "--tool-call-parser", "hermes"])) == "hermes"
    assert jobs.load_config(str(config)).max_num_seqs == 3
    with pytest.raises(jobs.UsageError, match="--tool-call-parser pythonic: unknown"):
        jobs.tool_settings(parse([*base, "--tool-call-parser", "pythonic"]))
