"""OpenAI's batch file format for batch jobs (OpenAI's Batch API, vLLM's ``run-batch``).

Input, one request per line (``entrypoints/jobs.py`` tells the formats apart per file)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}}
    {"custom_id": "q2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}}

The body is what the HTTP server takes at that URL (``protocol/openai.py``), checked the same
way (``speculation`` included); ``stream`` is refused. Chat messages go through the
tokenizer's chat template, as the server renders them; ``tools`` with ``tool_choice`` required or a
named function answer with ``tool_calls`` (``auto`` needs the job's ``--enable-auto-tool-choice``
and ``--tool-call-parser``, as the server's). ``max_tokens`` as the server
decides it: a number that overflows the context is refused, naming both numbers; without
one, chat runs up to the context and a completion gets 16. ``model`` is echoed, not checked:
a job serves the one model of its config. Every line is checked before anything runs.

Output, one line per request, in input order::

    {"id": "batch_req_...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "cmpl-...", "body": {...the HTTP response...}}}

``error`` stays null: a request that cannot be served is refused before the job starts.
A re-run keeps the lines already written and generates only the custom_ids missing.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specray.protocol import checks as C
from specray.protocol import openai as P
from specray.protocol import tools

log = logging.getLogger("specray.jobs")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DEFAULT_MAX_TOKENS = 16  # OpenAI's (and the server's default) for completions without max_tokens


class BatchLine(BaseModel):
    """One line of an OpenAI batch file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str = Field(..., min_length=1, description="Your id; unique in the file; copied to the output.")
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict[str, Any]


def is_batch_line(obj: dict) -> bool:
    """Does this (first) line of a file look like OpenAI's format rather than specray's?"""
    return "custom_id" in obj or ("url" in obj and "body" in obj)


@dataclass(frozen=True)
class BatchRequest:
    """A checked line: what to generate (``n`` choices of each prompt) and how to answer."""

    custom_id: str
    chat: bool
    model: str
    checked: C.Checked
    echo: bool = False
    tokenizer: Any = None  # for echoed text and log-probability tokens

    def requests(self) -> list[tuple]:
        """(prompt ids, sampling, speculation) for each choice, as ``Coordinator.generate`` takes them."""
        c = self.checked
        return [(ids, s.model_dump(), c.speculation) for ids, choices in zip(c.prompt_ids, c.samplings)
                for s in choices]

    def output_line(self, outs: list[dict]) -> str:
        """The OpenAI batch output line for this request's finished choices (the HTTP body)."""
        rid = P.request_id("chatcmpl" if self.chat else "cmpl")
        c = self.checked
        if c.prompt_only:
            outs = [P.prompt_only(o) for o in outs]
        n = len(c.samplings[0])
        echoes = [P.echo_of(c.prompts[i // n], c.prompt_ids[i // n], self.tokenizer) if self.echo else None
                  for i in range(len(outs))]
        choices = tools.choices(P.choices(outs, self.chat, echoes, P.token_text_of(self.tokenizer)), c.tools)
        body = P.completion_response(rid, self.model, choices, P.usage(outs, [len(ids) for ids in c.prompt_ids]),
                                     P.speculation_metrics(outs), self.chat)
        return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": self.custom_id,
                           "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}) + "\n"


Facts = C.Facts


def _format(exc: ValidationError) -> list[str]:
    return [f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()]


def check_line(obj: dict, facts: Facts) -> tuple[BatchRequest | None, list[str]]:
    """Validate one line as the server checks its request (``protocol/checks.py``); (request, [])
    or (None, every problem: the envelope's and the body's, as far as the body parses)."""
    problems: list[str] = []
    try:
        line = BatchLine.model_validate(obj)
    except ValidationError as exc:
        problems, line = _format(exc), None
    body = obj.get("body")
    if not isinstance(body, dict):
        return None, problems
    # The body as the server at its URL would take it (a wrong URL: as the body's shape says).
    chat = obj.get("url") == CHAT if obj.get("url") in (COMPLETIONS, CHAT) else "messages" in body
    try:
        req = C.parse(body, chat, prefix="body.", facts=facts)
    except C.RequestError as exc:
        return None, problems + exc.lines()
    if req.stream:
        problems.append("body.stream: streaming is not supported in a batch")
    try:
        checked = C.check(req, chat, facts, DEFAULT_MAX_TOKENS, prefix="body.")
    except C.RequestError as exc:
        problems += exc.lines()
    if problems:
        return None, problems
    return BatchRequest(line.custom_id, chat, req.model, checked, req.echo_prompt(),
                        facts.tokenizer), []


def check_unique(records: list[tuple[int, BatchRequest]]) -> list[tuple[int, str]]:
    """custom_id must be unique in a file (it is how outputs are matched and runs resume)."""
    seen: dict[str, int] = {}
    errors = []
    for lineno, rec in records:
        if rec.custom_id in seen:
            errors.append((lineno, f"custom_id: {rec.custom_id!r} repeats line {seen[rec.custom_id]}"))
        else:
            seen[rec.custom_id] = lineno
    return errors


def done_ids(path: str, records: list[BatchRequest], usage_error) -> set[str]:
    """custom_ids already answered in ``path``; a torn last line (a crash) is cut off.

    Every complete line must be an OpenAI batch output line for a custom_id of this input,
    at most once; anything else raises ``usage_error`` (another input, another format).
    """
    p = Path(path)
    if not p.exists():
        return set()
    data = p.read_bytes()
    known = {r.custom_id for r in records}
    done: set[str] = set()
    offset = keep = lineno = 0
    while offset < len(data):
        lineno += 1
        end = data.find(b"\n", offset)
        chunk = data[offset:] if end < 0 else data[offset:end]
        next_offset = len(data) if end < 0 else end + 1
        final = not data[next_offset:].strip()
        try:
            obj = json.loads(chunk)
            if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str) or "response" not in obj:
                raise ValueError("not an OpenAI batch output line")
        except ValueError:
            if final:
                log.warning("%s: dropping a truncated last line (%d bytes); it will be regenerated",
                            path, len(data) - offset)
                break
            raise usage_error(f"{path}: line {lineno} is not an OpenAI batch output line (corrupt file, or "
                              "another format?); fix or remove it, or use another --output") from None
        if end < 0:  # parses but has no newline: a torn write could still look complete
            log.warning("%s: last line has no newline; regenerating it", path)
            break
        cid = obj["custom_id"]
        if cid not in known:
            raise usage_error(f"{path}: line {lineno} answers custom_id {cid!r}, which is not in the input; "
                              "the input changed? use another --output")
        if cid in done:
            raise usage_error(f"{path}: line {lineno} answers custom_id {cid!r} a second time")
        done.add(cid)
        offset = keep = next_offset
    if keep < len(data):
        with open(p, "r+b") as f:
            f.truncate(keep)
    return done
