"""OpenAI-compatible request/response shapes (OpenAI's fields and vLLM's extensions), validated.

Requests are strict: an unknown field, a value of the wrong type or out of range is a 400
naming the field. vLLM's extensions are honoured where specray can (penalties, min_tokens,
special tokens, stop strings kept, ...); the rest of vLLM's list is accepted and named once
in the log (``IGNORED_VLLM_FIELDS``). docs/openai-api.md lists them all.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from specray.engine.params import SamplingParams, Speculation, StructuredOutputs
from specray.engine.intake import check_context_length
from specray.protocol import tools


# Request bodies are strict where OpenAI is: a boolean is not an integer, a string is not a
# boolean (``max_tokens: true``, ``stream: "yes"`` are 400s, as OpenAI and vLLM answer), and a
# float field takes an integer. Integers are bounded where they reach the engine (a seed fits
# int64, as vLLM takes it).
STRICT = ConfigDict(extra="forbid", strict=True)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM extension: usage (so far) in every chunk")
    include_speculation: bool = Field(
        False, description="specray extension: each chunk's choice lists the speculation steps that produced "
        "its text (``speculation``: drafted, accepted, rejected and bonus tokens; see serve/playground.py)"
    )


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema`` (what ``client.beta.chat.completions.parse``
    sends for a pydantic model)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="the output always matches (it does: every schema is enforced)")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise FieldError("json_schema", "json_schema is given with type 'json_schema', and only then")
        return self

    def constraint(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputs(json=self.json_schema.schema_ or {})
        return None


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "structural_tag": "structural_tag"}
"""vLLM's older structured-output fields (removed in its v0.12; older clients still send them)."""
GRAMMAR_BACKENDS = (None, "auto", "llguidance", "guidance")


class FieldError(ValueError):
    """A check across fields, raised by a model validator, that names the field at fault (pydantic
    would report it at the model: ``protocol/checks.py`` puts it at ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _unset(value):
    """Fields accepted only empty (not implemented: a 400, never a silent no-op)."""
    if value:
        raise ValueError("not supported")
    return value


def _neutral(value, neutral):
    if value not in (None, neutral):
        raise ValueError(f"not supported (must be {neutral})")
    return value


# vLLM's request fields specray cannot honour (``vllm/entrypoints/openai/protocol.py``,
# CompletionRequest and ChatCompletionRequest), with vLLM's defaults: accepted, so that tools
# written for vLLM run unchanged, and named once per process in the log when a request sets
# one to anything else. A field neither OpenAI nor vLLM knows stays a 400.
IGNORED_VLLM_FIELDS = {
    "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None, "bad_words": [],
    "priority": 0, "request_id": None, "logits_processors": None, "return_tokens_as_token_ids": None,
    "cache_salt": None, "kv_transfer_params": None, "vllm_xargs": None, "mm_processor_kwargs": None,
}
COMPLETION_ONLY_IGNORED = {"prompt_embeds": None}
CHAT_ONLY_IGNORED = {"echo": False, "include_reasoning": True, "reasoning_effort": None, "best_of": None}
log = logging.getLogger("specray.protocol")
_named: set[str] = set()


def _name_ignored(fields) -> None:
    """One warning per ignored field name per process."""
    for name in sorted(set(fields) - _named):
        _named.add(name)
        log.warning("request field %r accepted but ignored: specray cannot honour it (named once per process)",
                    name)


class _Common(BaseModel):
    model_config = STRICT

    model: str
    max_tokens: int | None = Field(None, ge=0, description="0: with echo, score the prompt only (as vLLM)")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    user: str | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string) -> bias in [-100, 100]")
    # vLLM's sampling extensions, honoured (engine/params.py: SamplingParams; engine/logits.py)
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="0/-1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="add the tokenizer's special tokens (BOS) to the "
                                            "prompt; default as vLLM: true for completions, false for chat")
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT64_MAX, description="keep the prompt's last N tokens")
    speculation: Speculation | None = Field(
        None, description="specray extension: per-request speculation, the options of its 'method'"
    )
    # Structured outputs (engine/grammar.py): vLLM's field, and its older spellings
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = Field(None, description="llguidance (or auto): the one specray runs")
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # Accepted and ignored (IGNORED_VLLM_FIELDS)
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Any = None
    bad_words: Any = None
    priority: Any = None
    request_id: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

    IGNORED: ClassVar[dict[str, Any]] = IGNORED_VLLM_FIELDS
    _constraint: tuple[str | None, StructuredOutputs | None] = PrivateAttr(default=(None, None))

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        """OpenAI's fields are "X or null": a null is the field not given (its default)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if not (v is None and k in fields and fields[k].default is not None)}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids as strings; {key!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of {key} is {bias}; biases lie in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self):
        """OpenAI and vLLM refuse stream options on a request that does not stream."""
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        return self

    @field_validator("guided_decoding_backend")
    @classmethod
    def _our_backend(cls, v):
        if v not in GRAMMAR_BACKENDS:
            raise ValueError(f"{v!r} is not available: specray's structured outputs run on llguidance")
        return v

    @field_validator("guided_whitespace_pattern")
    @classmethod
    def _not_supported(cls, v):
        return _unset(v)

    @model_validator(mode="after")
    def _one_constraint(self):
        """The fields that ask for structured output, read once: (field, constraint) of at most one."""
        given = []
        if self.response_format is not None and self.response_format.constraint() is not None:
            given.append(("response_format", self.response_format.constraint()))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs))
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                try:
                    given.append((name, StructuredOutputs(**{kind: value})))
                except ValidationError as exc:
                    raise FieldError(name, exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
        if len(given) > 1:
            raise FieldError(given[1][0], f"one structured output per request; {given[0][0]} gives one already")
        self._constraint = given[0] if given else (None, None)
        return self

    def constraint(self) -> StructuredOutputs | None:
        return self._constraint[1]

    def constraint_field(self) -> str | None:
        return self._constraint[0]

    @model_validator(mode="after")
    def _name_the_ignored(self):
        _name_ignored(name for name, default in self.IGNORED.items()
                      if name in self.model_fields_set and getattr(self, name) not in (None, default))
        return self

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(field, value) of the client's own output limit; None when it gave none."""
        return "max_tokens", self.max_tokens

    def top_logprobs_asked(self) -> int | None:
        """Alternatives per token the client asked for (None: no log-probabilities)."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        return None

    def special_tokens(self) -> bool:
        """Does tokenising the prompt add the tokenizer's special tokens?"""
        return True if self.add_special_tokens is None else self.add_special_tokens

    def echo_prompt(self) -> bool:
        """Does each choice's text start with its prompt (OpenAI's completions ``echo``)?"""
        return False

    def named_token_ids(self) -> dict[str, list[int]]:
        """field -> the token ids it names (each must be the model's)."""
        return {"stop_token_ids": self.stop_token_ids or [], "allowed_token_ids": self.allowed_token_ids or [],
                "logit_bias": [int(k) for k in self.logit_bias or {}]}

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
            logprobs=self.top_logprobs_asked(),
            prompt_logprobs=self.prompt_logprobs_asked(),
            min_tokens=self.min_tokens,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            min_p=self.min_p,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.constraint(),
        )


def _prompt_shape(v):
    """OpenAI's four prompt forms, checked here so a wrong one is one message (a union's
    per-member errors would be four)."""
    def ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and (ids(v) or all(isinstance(p, str) for p in v) or all(ids(p) for p in v)):
        if any(not p for p in v if isinstance(p, list)):
            raise ValueError("a prompt in the list is empty")
        return v
    if isinstance(v, list) and not v:
        raise ValueError("prompt is empty")
    raise ValueError("must be a string, a list of strings, a list of token ids, or a list of token-id lists")


class CompletionRequest(_Common):
    prompt: Any = Field(..., description="text, token ids, or a list of either: each element its own prompt")
    echo: bool = Field(False, description="prepend the prompt to the text (with logprobs: the prompt's too)")
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of this many alternatives "
                                 "per token (the target's raw distribution)")
    suffix: str | None = None
    best_of: int | None = None
    prompt_embeds: Any = None  # vLLM's, ignored
    IGNORED: ClassVar[dict[str, Any]] = {**IGNORED_VLLM_FIELDS, **COMPLETION_ONLY_IGNORED}

    @field_validator("prompt")
    @classmethod
    def _forms(cls, v):
        return _prompt_shape(v)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _unset(v)

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        return _neutral(v, 1)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (a string or token ids), in order: OpenAI's four forms."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None

    def echo_prompt(self) -> bool:
        return self.echo


class TextPart(BaseModel):
    """A content part of a chat message; text is the only kind a text model reads."""

    model_config = STRICT
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCall(BaseModel):
    """A call an assistant made, sent back in the conversation that follows it."""

    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (none: no arguments)")
    strict: bool | None = Field(None, description="the arguments always match (constrained calls: they do)")

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, v):
        return v if v is None else tools.check_parameters(v)


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str = Field(..., min_length=1)


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    model_config = STRICT
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(BaseModel):
    """OpenAI's message shapes: ``content`` a string or text parts; an assistant's may be null
    (with or without ``tool_calls``); a ``tool`` message answers a call by ``tool_call_id``."""

    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant's, as OpenAI returns it

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list):  # one message for the first part a text model cannot read
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"part {i} is {kind!r}: only 'text' content parts are supported "
                                     "(this server runs a text-only model)")
        return v

    @model_validator(mode="after")
    def _role_fields(self):
        if self.content is None and self.role != "assistant":
            raise FieldError("content", f"a {self.role} message needs content (only an assistant's may be null)")
        if self.tool_calls is not None and self.role != "assistant":
            raise FieldError("tool_calls", "tool_calls belong to assistant messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise FieldError("tool_call_id", "a tool message needs the tool_call_id it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise FieldError("tool_call_id", "tool_call_id belongs to tool messages")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' ``apply_chat_template``, as vLLM
        hands it over): text parts joined by newlines, a null content as "", a tool call's JSON
        arguments as an object."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        out = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _json_object(c.function.arguments)}}
                                 for c in self.tool_calls]
        return out


def _json_object(text: str):
    """Tool-call arguments as templates expect them (an object); text that is not one stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="return each token's log-probability (the target's raw distribution)")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token (needs logprobs)")
    tools: list[Tool] | None = Field(None, description="rendered by the chat template; see tool_choice")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none: text; auto (the default with tools): calls parsed by the server's "
        "--tool-call-parser; required, or a named function: the output constrained to calls (protocol/tools.py)")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default: several allowed)")
    # vLLM's chat template extensions, honoured (transformers' apply_chat_template takes them)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="leave the last (assistant) message open to continue it")
    chat_template: str | None = Field(None, description="a Jinja template instead of the tokenizer's")
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    # vLLM's chat fields specray ignores (CHAT_ONLY_IGNORED; ``echo`` here is vLLM's, not OpenAI's)
    echo: Any = None
    include_reasoning: Any = None
    reasoning_effort: Any = None
    best_of: Any = None
    IGNORED: ClassVar[dict[str, Any]] = {**IGNORED_VLLM_FIELDS, **CHAT_ONLY_IGNORED}

    def special_tokens(self) -> bool:
        return bool(self.add_special_tokens)  # vLLM's chat default: the template adds them

    def render(self, tokenizer) -> str:
        """The conversation as the model's chat template writes it (a text prompt)."""
        return tokenizer.apply_chat_template(
            [m.for_template() for m in self.messages],
            tools=None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools],
            documents=self.documents, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=self.add_generation_prompt, continue_final_message=self.continue_final_message,
            **(self.chat_template_kwargs or {}))

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_choice(cls, v):
        """One message for a wrong tool_choice (a union would give one per member)."""
        if isinstance(v, dict):
            try:
                return NamedToolChoice.model_validate(v)
            except ValidationError as exc:
                err = exc.errors()[0]
                raise ValueError(f"{'.'.join(map(str, err['loc']))}: {err['msg']}; a named function is "
                                 '{"type": "function", "function": {"name": "my_function"}}') from None
        if v is not None and v not in ("none", "auto", "required"):
            raise ValueError(f"{v!r} is not 'none', 'auto', 'required' or "
                             '{"type": "function", "function": {"name": "my_function"}}')
        return v

    def tool_mode(self) -> str:
        """none, auto, required or named (OpenAI's default: auto when tools are given, else none)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    @model_validator(mode="after")
    def _tool_choice_fits(self):
        """vLLM's checks of tool_choice against tools; required and named constrain the output
        (one structured output per request: they take the constraint's place)."""
        if self.tools is not None and not self.tools:
            raise FieldError("tools", "must not be empty: give at least one tool, or leave tools out")
        mode = self.tool_mode()
        if mode in ("none", "auto"):
            if self.tool_choice == "auto" and not self.tools:
                raise FieldError("tool_choice", "tool_choice 'auto' needs tools")
            return self
        names = [t.function.name for t in self.tools or []]
        if not names:
            raise FieldError("tool_choice", f"tool_choice {mode} needs tools")
        named = self.tool_choice.function.name if mode == "named" else None
        if named is not None and named not in names:
            raise FieldError("tool_choice", f"function {named!r} is not among the tools ({', '.join(names)})")
        if self._constraint[0] is not None:
            raise FieldError("tool_choice", f"tool_choice {mode} constrains the output to tool calls; "
                             f"{self._constraint[0]} asks for another structured output (one per request)")
        try:
            schema = tools.call_schema([(t.function.name, t.function.parameters) for t in self.tools], named,
                                       self.parallel_tool_calls is not False)
        except ValueError as exc:
            raise FieldError("tools", str(exc)) from None
        self._constraint = ("tools", StructuredOutputs(json=schema))
        return self

    @model_validator(mode="after")
    def _one_ending(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise FieldError("continue_final_message", "needs add_generation_prompt: false (vLLM's rule)")
        return self

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    def requested_max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().requested_max_tokens()

    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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


def choice(index: int, text: str, finish_reason: str | None, chat: bool) -> dict:
    if not chat:
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
            "logprobs": None}


def delta_choice(index: int, body: dict, finish_reason: str | None, chat: bool) -> dict:
    """A streamed choice: chat's ``delta`` (content, or tool-call deltas), a completion's text."""
    if not chat:
        return choice(index, body.get("content", ""), finish_reason, chat)
    return {"index": index, "delta": body, "finish_reason": finish_reason, "logprobs": None}


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


def usage(finals: list[dict], prompt_sizes: list[int] | None = None) -> dict:
    """OpenAI usage of a request's choices (each prompt counted once, however many choices)."""
    if prompt_sizes is not None:
        prompt = sum(prompt_sizes)
    else:
        prompt = len(finals[0]["prompt_token_ids"]) if finals else 0
    completion = sum(len(o["token_ids"]) for o in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Echo:
    """A completion's prompt, echoed before its text (``echo``): its text and token ids."""

    text: str
    ids: list[int]


def logprobs_body(entries: list[dict], token_text, chat: bool, prompt: list | None = None,
                  prompt_ids: list[int] | None = None) -> dict:
    """OpenAI's ``logprobs`` of a choice from specray's entries (``engine/logprobs.py``).

    Completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob) and
    ``text_offset``, the echoed prompt's tokens first (its first token has none). Chat:
    ``content``, one object per token with ``bytes`` and its ``top_logprobs``.
    """
    if chat:
        def item(token_id, logprob):
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e["id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                            for e in entries]}
    rows = []
    if prompt is not None and prompt_ids is not None:
        rows = [(t, e["logprob"] if e else None, {token_text(i): lp for i, lp in e["top"]} if e else None)
                for t, e in zip(prompt_ids, prompt)]
    rows += [(e["id"], e["logprob"], {token_text(i): lp for i, lp in e["top"]}) for e in entries]
    tokens = [token_text(t) for t, _, _ in rows]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows], "top_logprobs": [top for _, _, top in rows],
            "text_offset": offsets}


def echo_of(prompt: str | list[int], ids: list[int], tokenizer) -> Echo:
    text = prompt if isinstance(prompt, str) else (tokenizer.decode(prompt) if tokenizer is not None else "")
    return Echo(text, ids)


def token_text_of(tokenizer):
    """token id -> the text a log-probability entry shows for it ("token_id:N" without a tokenizer)."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def choice_logprobs(out: dict, chat: bool, echo: Echo | None, token_text, start: int = 0) -> dict | None:
    """A choice's ``logprobs`` (its tokens from ``start``; the echoed prompt's with the first);
    None when the request did not ask."""
    entries = out.get("logprobs")
    if entries is None:
        return None
    prompt = out.get("prompt_logprobs") if echo is not None and start == 0 else None
    return logprobs_body(entries[start:], token_text, chat, prompt, echo.ids if echo else None)


def prompt_only(out: dict) -> dict:
    """A choice of a prompt-scoring request (``max_tokens: 0`` with ``echo``): the prefill sampled
    a token, which is not the client's; it keeps the prompt's log-probabilities only."""
    return {**out, "text": "", "token_ids": [], "new_token_ids": [], "finish_reason": "length",
            "logprobs": [] if out.get("logprobs") is not None else None}


def choices(finals: list[dict], chat: bool, echoes: list[Echo | None], token_text) -> list[dict]:
    """The choices of a finished (non-streamed) response, numbered as the outputs come."""
    out = []
    for i, (final, echo) in enumerate(zip(finals, echoes)):
        c = choice(i, (echo.text if echo else "") + final["text"], finish_reason(final["finish_reason"]), chat)
        c["logprobs"] = choice_logprobs(final, chat, echo, token_text)
        out.append(c)
    return out
