"""Tool calls in a model's text: found whole, or as the text streams.

The formats, by vLLM's ``--tool-call-parser`` names:

* ``hermes`` (Hermes 2 Pro / 3, Qwen2.5, Qwen3): free text, then one or more
  ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``.
* ``llama3_json`` (also ``llama4_json``; Llama 3.1 / 3.2 / 4 JSON tool calling):
  ``{"name": "f", "parameters": {...}}``, possibly after ``<|python_tag|>``, several separated by
  ``;``.

and the two shapes specray's own constrained tool calls take (``protocol/tools.py``):

* ``required``: a JSON array of ``{"name": ..., "parameters": {...}}`` objects;
* ``named``: the arguments object of the one function named in ``tool_choice``.

A call object may name its arguments ``arguments`` or ``parameters``. A call's arguments are the
model's own JSON text of them, so what a stream sends adds up to what a whole reply holds. A
call that does not parse makes the whole text the reply's content (no tool calls), as vLLM's
parsers answer.

    >>> parse(FORMATS["hermes"], 'Sure.\\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    ParsedCalls(content='Sure.', calls=[('f', '{"x": 1}')])
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable

ARGUMENT_KEYS = ("arguments", "parameters")
LITERAL_CHARS = frozenset("0123456789+-.eEtruefalsn")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class Malformed(ValueError):
    """Text where a call should be that is not one."""


@dataclass
class Call:
    """A call as far as the text goes: its name once its string is closed, the arguments' JSON
    text known so far (all of it once ``done``)."""

    name: str | None
    arguments: str
    done: bool


@dataclass
class Scan:
    """What a text holds so far: the content that is surely content, the calls begun."""

    content: str
    calls: list[Call] = field(default_factory=list)
    malformed: bool = False


# -- a JSON call object, read as far as the text goes ----------------------------------------------
@dataclass
class Memo:
    """What scans of a growing text found, by position. A stream's text only grows at its end,
    so a value that closed stays closed where it closed, a call that finished stays that call,
    and a value still open resumes where the last scan stopped: a feed reads what it adds and
    steps over what earlier feeds read, not the whole reply again."""

    values: dict[int, int | tuple[int, int, bool]] = field(default_factory=dict)  # start -> end | (at, depth, quoted)
    calls: dict[int, tuple[Call, int]] = field(default_factory=dict)  # start -> (finished call, end)


Format = Callable[[str, bool, Memo], Scan]
"""A format: (the text so far, whether it is whole, what scans of its shorter texts found) -> its scan."""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int, memo: Memo) -> int | None:
    """End (exclusive) of the JSON value starting at text[i]; None if the text stops inside it."""
    if text[i] not in '"{[':
        j = i
        while j < len(text) and text[j] in LITERAL_CHARS:
            j += 1
        if j == i:
            raise Malformed(f"not a JSON value at {text[i:i + 20]!r}")
        return None if j == len(text) else j
    state = memo.values.get(i, (i, 0, False))
    if isinstance(state, int):
        return state
    j, depth, quoted = state
    while j < len(text):
        c = text[j]
        if quoted:
            if c == "\\":
                j += 1  # the escaped character is skipped with it
            elif c == '"':
                quoted = False
                if depth == 0:
                    memo.values[i] = j + 1
                    return j + 1
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                memo.values[i] = j + 1
                return j + 1
        j += 1
    memo.values[i] = (j, depth, quoted)
    return None


def _call_object(text: str, i: int, memo: Memo) -> tuple[Call, int | None]:
    """The call object starting at text[i] and its end (None while it is not closed)."""
    if i in memo.calls:
        return memo.calls[i]
    if text[i] != "{":
        raise Malformed(f"a call is a JSON object, not {text[i:i + 20]!r}")
    name, args_at, args_end, j = None, None, None, i + 1
    while True:
        j = _skip_ws(text, j)
        if j >= len(text):
            break
        if text[j] == "}":
            memo.calls[i] = _finished(text, i, j + 1, args_at, args_end)
            return memo.calls[i]
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            raise Malformed(f"a key is a JSON string, not {text[j:j + 20]!r}")
        key_end = _value_end(text, j, memo)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = _skip_ws(text, key_end)
        if j < len(text) and text[j] != ":":
            raise Malformed("a key is followed by ':'")
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = _value_end(text, j, memo)
        if key == "name" and end is not None:
            name = json.loads(text[j:end])
        elif key in ARGUMENT_KEYS:
            args_at, args_end = j, end
        if end is None:
            break
        j = end
    known = ""
    if args_at is not None and text[args_at] in "{[":  # an object's text is its own from the first brace
        known = text[args_at:args_end]
    return Call(name if isinstance(name, str) else None, known, False), None


def _finished(text: str, start: int, end: int, args_at: int | None, args_end: int | None) -> tuple[Call, int]:
    try:
        obj = json.loads(text[start:end])
    except ValueError as exc:
        raise Malformed(f"a call does not parse: {exc}") from None
    if not isinstance(obj.get("name"), str):
        raise Malformed("a call names its function with a string 'name'")
    args = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    if isinstance(args, str):  # arguments as a JSON string (some models write them so)
        try:
            if not isinstance(json.loads(args), dict):
                raise ValueError
        except ValueError:
            raise Malformed("a call's arguments are a JSON object") from None
        return Call(obj["name"], args, True), end
    if not isinstance(args, dict):
        raise Malformed("a call's arguments are a JSON object")
    return Call(obj["name"], text[args_at:args_end] if args_at is not None else "{}", True), end


# -- the formats -------------------------------------------------------------------------------------
def _held(text: str, marker: str) -> str:
    """Text that is surely content while ``marker`` may still begin at its end: without a tail
    that could be the marker's start, and without trailing whitespace (stripped before a call)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            text = text[:-k]
            break
    return text.rstrip()


def _calls_after(text: str, i: int, memo: Memo, separator: str, stop: str | None = None) -> list[Call]:
    """Call objects from text[i] on, joined by ``separator``, up to ``stop`` (then only whitespace)."""
    calls = []
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return calls
        if stop and not calls and text.startswith(stop, i):
            return _only_space_after(text, i + len(stop), calls)
        call, end = _call_object(text, i, memo)
        calls.append(call)
        if end is None:
            return calls
        i = _skip_ws(text, end)
        if i >= len(text):
            return calls
        if stop and text.startswith(stop, i):
            return _only_space_after(text, i + len(stop), calls)
        if not text.startswith(separator, i):
            raise Malformed(f"after a call: {text[i:i + 20]!r}")
        i += len(separator)


def _only_space_after(text: str, i: int, calls: list[Call]) -> list[Call]:
    if text[i:].strip():
        raise Malformed(f"text after the calls: {text[i:i + 20]!r}")
    return calls


def scan_hermes(text: str, final: bool, memo: Memo) -> Scan:
    """Each call inside ``<tool_call>...</tool_call>`` (the last one may stay open); text before
    the first is content, text after a call is not read."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return Scan(text if final else _held(text, HERMES_OPEN))
    scan = Scan(text[:start].rstrip())
    while start >= 0:
        i = _skip_ws(text, start + len(HERMES_OPEN))
        if i >= len(text):
            break
        call, end = _call_object(text, i, memo)
        scan.calls.append(call)
        if end is None:
            break
        i = _skip_ws(text, end)
        if not (text.startswith(HERMES_CLOSE, i) or HERMES_CLOSE.startswith(text[i:])):
            raise Malformed(f"a call ends with {HERMES_CLOSE}, not {text[i:i + 20]!r}")
        start = text.find(HERMES_OPEN, i)
    return scan


def scan_llama3_json(text: str, final: bool, memo: Memo) -> Scan:
    """Calls from the first character (or after ``<|python_tag|>``, text before it content),
    separated by ``;``."""
    tag = text.find(PYTHON_TAG)
    if tag >= 0:
        return Scan(text[:tag].rstrip(), _calls_after(text, tag + len(PYTHON_TAG), memo, ";"))
    first = _skip_ws(text, 0)
    if first < len(text) and text[first] == "{":
        return Scan("", _calls_after(text, first, memo, ";"))
    return Scan(text if final else _held(text, PYTHON_TAG))


def scan_required(text: str, final: bool, memo: Memo) -> Scan:
    """A JSON array of calls."""
    i = _skip_ws(text, 0)
    if i >= len(text):
        return Scan("")
    if text[i] != "[":
        raise Malformed("tool calls are a JSON array")
    return Scan("", _calls_after(text, i + 1, memo, ",", stop="]"))


def scan_named(name: str) -> Format:
    """The whole text is the one call's arguments."""
    def scan(text: str, final: bool, memo: Memo) -> Scan:
        body = text.strip()
        if not final:
            return Scan("", [Call(name, text.lstrip().rstrip(), False)])
        try:
            if not isinstance(json.loads(body), dict):
                raise ValueError
        except ValueError:
            raise Malformed("the arguments are a JSON object") from None
        return Scan("", [Call(name, body, True)])

    return scan


FORMATS: dict[str, Format] = {
    "hermes": scan_hermes,
    "llama3_json": scan_llama3_json,
    "llama4_json": scan_llama3_json,
}
"""The parsers ``--tool-call-parser`` takes (vLLM's names)."""
PARSER_NAMES = tuple(FORMATS)
SPECIAL_MARKERS = {"hermes": (HERMES_OPEN, HERMES_CLOSE), "llama3_json": (PYTHON_TAG,), "llama4_json": (PYTHON_TAG,)}
"""Markers a parser reads: where a tokenizer makes them special tokens, they must stay in the text."""


def _scan(fmt: Format, text: str, final: bool, memo: Memo) -> Scan:
    try:
        return fmt(text, final, memo)
    except Malformed:
        return Scan("", [], malformed=True)


# -- whole replies -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedCalls:
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments as JSON text)


def parse(fmt, text: str) -> ParsedCalls:
    """A whole reply's content and calls; a call that does not parse, or one left unfinished,
    makes the whole text the content."""
    scan = _scan(fmt, text, True, Memo())
    if scan.malformed or not scan.calls or not all(c.done for c in scan.calls):
        return ParsedCalls(text, [])
    return ParsedCalls(scan.content or None, [(c.name, c.arguments) for c in scan.calls])


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- streamed replies --------------------------------------------------------------------------------
class CallStream:
    """OpenAI's streamed deltas of one choice's reply: content, then per call a first delta with
    its index, id, type and name, then its arguments in pieces.

    ``feed`` takes the reply's text so far (each call a longer one, the last one's text at its
    start) and returns the deltas that text adds; ``final`` says it is the whole reply. A call is sent once its name is known, in
    order; a reply whose calls do not parse, with none sent yet, ends as content.
    """

    def __init__(self, fmt: Format):
        self.fmt = fmt
        self.memo = Memo()  # what earlier feeds read: a feed reads only the text it adds
        self.content_sent = 0
        self.sent: list[tuple[str, int]] = []  # per call sent: (id, argument characters sent)

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, text: str, final: bool) -> list[dict]:
        scan = _scan(self.fmt, text, final, self.memo)
        out = []
        if scan.malformed or (final and not self.sent and not all(c.done for c in scan.calls)):
            if final and not self.sent and len(text) > self.content_sent:
                out.append({"content": text[self.content_sent:]})
                self.content_sent = len(text)
            return out
        if len(scan.content) > self.content_sent:
            out.append({"content": scan.content[self.content_sent:]})
            self.content_sent = len(scan.content)
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break
            if index == len(self.sent):
                self.sent.append((call_id(), 0))
                out.append({"tool_calls": [{"index": index, "id": self.sent[index][0], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            ident, done = self.sent[index]
            if len(call.arguments) > done:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[done:]}}]})
                self.sent[index] = (ident, len(call.arguments))
        return out
