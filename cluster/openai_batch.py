"""OpenAI's batch file format for batch jobs (OpenAI's Batch API, vLLM's ``run-batch``).

Input, one request per line (``cluster/jobs.py`` tells the formats apart per file)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "def fib(n):", "max_tokens": 64, "temperature": 0}}
    {"custom_id": "q2", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}}

The body is what the HTTP server takes at that URL (``serve/protocol.py``), checked the same
way (``speculation`` included); ``stream`` is refused. Chat messages go through the
tokenizer's chat template, as the server renders them. ``max_tokens`` as the server
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

from specray.engine.scheduler import ContextLengthError, check_context_length, encode_prompt
from specray.policies.registry import Limits, validate_speculation
from specray.serve import protocol as P

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
    """A checked line: what to generate (``n`` choices of one prompt) and how to answer."""

    custom_id: str
    chat: bool
    model: str
    prompt: str | list[int]
    samplings: tuple[dict, ...]  # one per choice (seed + i when seeded, as the server does)
    speculation: dict | None

    def requests(self) -> list[tuple]:
        """(prompt, sampling, speculation) for each choice, as ``Coordinator.generate`` takes them."""
        return [(self.prompt, s, self.speculation) for s in self.samplings]

    def output_line(self, outs: list[dict]) -> str:
        """The OpenAI batch output line for this request's finished choices."""
        rid = P.request_id("chatcmpl" if self.chat else "cmpl")
        choices = [P.choice(i, o["text"], P.finish_reason(o["finish_reason"]), self.chat) for i, o in enumerate(outs)]
        body = P.completion_response(rid, self.model, choices, P.usage(outs), P.speculation_metrics(outs), self.chat)
        return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": self.custom_id,
                           "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}) + "\n"


@dataclass
class Facts:
    """What checking a line needs from the checkpoints (read once per file)."""

    tokenizer: Any
    context: int
    vocab_size: int
    limits: Limits
    default_speculation: Any


def _format(exc: ValidationError, prefix: str = "") -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        out.append(f"{prefix}{loc}: {err['msg']}" if loc else f"{prefix.rstrip('.') or '(root)'}: {err['msg']}")
    return out


def check_line(obj: dict, facts: Facts) -> tuple[BatchRequest | None, list[str]]:
    """Validate one line as the server would its request; (request, []) or (None, problems)."""
    try:
        line = BatchLine.model_validate(obj)
    except ValidationError as exc:
        return None, _format(exc)
    chat = line.url == CHAT
    try:
        req = (P.ChatCompletionRequest if chat else P.CompletionRequest).model_validate(line.body)
    except ValidationError as exc:
        return None, _format(exc, "body.")
    if req.stream:
        return None, ["body.stream: streaming is not supported in a batch"]
    if chat:
        tok = facts.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return None, ["body.messages: the model has no chat template; use /v1/completions"]
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        prompt = req.prompt
    field = "body.messages" if chat else "body.prompt"
    try:
        ids = encode_prompt(prompt, facts.tokenizer)
    except ValueError as exc:
        return None, [f"{field}: {exc}"]
    if not ids:
        return None, [f"{field}: the prompt is empty"]
    if min(ids) < 0 or max(ids) >= facts.vocab_size:
        return None, [f"{field}: token ids must lie in [0, {facts.vocab_size})"]
    try:
        check_context_length(len(ids), None, facts.context)
    except ContextLengthError as exc:
        return None, [f"{field}: {exc}"]
    try:
        max_tokens = P.resolve_max_tokens(req, len(ids), facts.context, DEFAULT_MAX_TOKENS, chat)
    except ContextLengthError as exc:
        return None, [f"body.{req.requested_max_tokens()[0]}: {exc}"]
    try:
        validate_speculation(req.speculation or facts.default_speculation, facts.limits)
    except ValueError as exc:
        return None, [f"body.speculation: {exc}"]
    try:
        samplings = tuple(req.sampling(max_tokens, i).model_dump() for i in range(req.n))
    except ValidationError as exc:
        return None, _format(exc, "body.")
    spec = req.speculation.model_dump() if req.speculation else None
    return BatchRequest(line.custom_id, chat, req.model, prompt, samplings, spec), []


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
