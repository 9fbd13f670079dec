"""OpenAI-compatible request/response shapes (the subset specray serves, validated).

Requests are strict: an unknown field or a value out of range is a 400 naming the
field. OpenAI fields specray accepts but does not implement must keep their neutral
value (e.g. ``presence_penalty=0``); anything else is a clear 400, not a silent no-op.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specray.engine.params import SamplingParams, Speculation
from specray.engine.scheduler import check_context_length


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_speculation: bool = Field(
        False, description="specray extension: each chunk's choice lists the speculation steps that produced "
        "its text (``speculation``: drafted, accepted, rejected and bonus tokens; see serve/playground.py)"
    )


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="vLLM extension; 0/-1 = off")
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    # Accepted for compatibility only at their neutral values.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    speculation: Speculation | None = Field(
        None, description="specray extension: per-request speculation, the options of its 'method'"
    )

    @model_validator(mode="after")
    def _unsupported(self):
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(self, name) != neutral:
                raise ValueError(f"{name} is not supported (must be {neutral})")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs is not supported")
        return self

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(field, value) of the client's own output limit; None when it gave none."""
        return "max_tokens", self.max_tokens

    def sampling(self, default_max_tokens: int, index: int = 0) -> SamplingParams:
        seed = None if self.seed is None else self.seed + index  # n > 1: distinct streams
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(..., description="text, token ids, or one-element list of text")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().requested_max_tokens()

    def sampling(self, default_max_tokens: int, index: int = 0) -> SamplingParams:
        params = super().sampling(default_max_tokens, index)
        if self.max_completion_tokens is not None:
            params = params.model_copy(update={"max_tokens": self.max_completion_tokens})
        return params


def resolve_max_tokens(req: _Common, prompt_tokens: int, context: int, default_max_tokens: int, chat: bool) -> int:
    """The max_tokens a request gets, as vLLM and OpenAI decide it.

    A client's own number must fit: prompt + max_tokens > context raises ContextLengthError
    naming both (HTTP 400). Without one, chat runs up to the context (OpenAI's chat default)
    and a completion gets ``default_max_tokens`` (OpenAI's 16), cut to the room left.
    """
    _, asked = req.requested_max_tokens()
    if asked is not None:
        check_context_length(prompt_tokens, asked, context)
        return asked
    room = context - prompt_tokens
    return room if chat else min(default_max_tokens, room)


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, kind: str, code: int | str | None = None, param: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_response(rid: str, model: str, choices: list[dict], usage: dict, spec: list[dict], chat: bool) -> dict:
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        "speculation_metrics": spec,
    }


def ran_method(out: dict) -> str | None:
    """The speculation method that made an output (its last step says; None if aborted)."""
    return (out.get("step") or {}).get("method")


def speculation_metrics(finals: list[dict]) -> list[dict]:
    """Per choice: the method that ran and its acceptance counters (``speculation_metrics``)."""
    return [{"method": ran_method(o), **o["metrics"]} for o in finals]


def choice(index: int, text: str, finish_reason: str | None, chat: bool, delta: bool = False) -> dict:
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    key = "delta" if delta else "message"
    body = {"content": text} if delta else {"role": "assistant", "content": text}
    return {"index": index, key: body, "finish_reason": finish_reason, "logprobs": None}


def chunk(rid: str, model: str, choices: list[dict], chat: bool, usage: dict | None = None) -> dict:
    body = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


def finish_reason(reason: str | None) -> str | None:
    """specray's reasons in OpenAI's words ('abort'/'error' never reach a client)."""
    return {"stop": "stop", "length": "length"}.get(reason, reason)


def sse(body: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body)}\n\n"


def usage(finals: list[dict]) -> dict:
    """OpenAI usage of a request's choices (the prompt counted once)."""
    prompt = len(finals[0]["prompt_token_ids"]) if finals else 0
    completion = sum(len(o["token_ids"]) for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
