"""Tool calling: what a request's ``tool_choice`` makes of its output, and its reply's ``tool_calls``.

* ``none`` — the tools reach the chat template; the reply is text, never parsed.
* ``auto`` (the default when ``tools`` are given) — the model writes what it writes; the server's
  ``--tool-call-parser`` (``protocol/tool_parsers.py``) finds the calls in it. Without
  ``--enable-auto-tool-choice`` and a parser it is a 400, as vLLM answers.
* ``required`` — the grammar layer constrains the output to a JSON array of
  ``{"name": ..., "parameters": {...}}`` objects, each one of the tools with arguments valid under
  its ``parameters`` schema (vLLM's shape); ``parallel_tool_calls: false`` allows exactly one.
* a named function — the output is that function's arguments object, valid under its schema.

The constrained shapes are exact under every speculative method: they are structured outputs.

    >>> plan = ToolPlan("required", parallel=True)
    >>> message({"role": "assistant", "content": '[{"name": "f", "parameters": {}}]'}, plan)["tool_calls"][0]["function"]
    {'name': 'f', 'arguments': '{}'}
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from specray.protocol import tool_parsers as T

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function declared without ``parameters``: none."""


def check_parameters(schema: dict) -> dict:
    """A function's ``parameters`` must be a JSON schema (checked against its metaschema)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None
    return schema


def call_schema(functions: list[tuple[str, dict | None]], named: str | None, parallel: bool) -> dict:
    """The JSON schema a constrained tool call follows: the named function's arguments, or an
    array of ``{"name", "parameters"}`` calls of any of ``functions`` (name, parameters). Each
    schema's ``$defs`` move to the top, where its ``#/$defs/...`` references find them."""
    if named is not None:
        return copy.deepcopy(dict(functions)[named] or NO_PARAMETERS)
    defs: dict = {}
    calls = []
    for name, parameters in functions:
        parameters = copy.deepcopy(parameters or NO_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise ValueError(f"two tools define $defs {key!r} differently; one array of calls cannot hold both")
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass(frozen=True)
class ToolPlan:
    """How a request's reply is read for tool calls: ``mode`` auto (by ``parser``), required or
    named (``function``)."""

    mode: str
    parallel: bool = True
    parser: str | None = None
    function: str | None = None

    def format(self):
        if self.mode == "required":
            return T.scan_required
        if self.mode == "named":
            return T.scan_named(self.function)
        return T.FORMATS[self.parser]

    def keeps_special_tokens(self, specials: frozenset[str]) -> bool:
        """Must the text keep special tokens? Where the tokenizer's ``specials``
        (``special_tokens``) hold the parser's markers (Qwen's ``<tool_call>``), skipping them
        would hide every call."""
        return self.mode == "auto" and not specials.isdisjoint(T.SPECIAL_MARKERS.get(self.parser, ()))

    def stream(self) -> T.CallStream:
        return T.CallStream(self.format())


def special_tokens(tokenizer) -> frozenset[str]:
    """What decoding with ``skip_special_tokens`` leaves out: the tokenizer's named special tokens
    and its added tokens marked special."""
    specials = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    specials |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
                 if getattr(t, "special", False)}
    return frozenset(specials)


def plan_for(req, parser: str | None) -> ToolPlan | None:
    """The plan of a chat request (None: its reply is text); ``parser`` is the server's, None
    when auto tool choice is off (``auto_problem`` says so first)."""
    mode = req.tool_mode()
    if mode == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    if mode == "named":
        return ToolPlan("named", parallel, function=req.tool_choice.function.name)
    if mode == "auto" and parser is None:
        return None
    return ToolPlan(mode, parallel, parser if mode == "auto" else None)


def auto_problem(req, parser: str | None) -> str | None:
    """vLLM's answer to ``auto`` on a server without a tool-call parser."""
    return AUTO_NEEDS_FLAGS if req.tool_mode() == "auto" and parser is None else None


def tool_calls(calls: list[tuple[str, str]]) -> list[dict]:
    return [{"id": T.call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


def message(msg: dict, plan: ToolPlan) -> dict:
    """A reply's message with its calls as ``tool_calls`` (content: the text outside them, or
    None); unchanged when it holds none."""
    parsed = T.parse(plan.format(), msg["content"])
    if not parsed.calls:
        return msg
    return {**msg, "content": parsed.content, "tool_calls": tool_calls(parsed.calls)}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` where the model stopped after calling."""
    return "tool_calls" if called and reason == "stop" else reason


def choices(chat_choices: list[dict], plan: ToolPlan | None) -> list[dict]:
    """Whole replies' choices with their tool calls."""
    if plan is None:
        return chat_choices
    out = []
    for c in chat_choices:
        msg = message(c["message"], plan)
        out.append({**c, "message": msg, "finish_reason": finish_reason(c["finish_reason"], "tool_calls" in msg)})
    return out
