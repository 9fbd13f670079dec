"""One check of an OpenAI request, for the HTTP server and for batch files alike.

A request is checked whole before anything runs, and every problem is reported at once
(``RequestError.problems``: (param, message) pairs; ``param`` is OpenAI's: the field at
fault): the body's shape (pydantic collects every field's error), then each prompt against
the model (a tokenizer for text, the vocabulary for token ids, the context), the output
limit against the context, and the speculation against what the server has loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from pydantic import ValidationError

from specray.engine.params import SamplingParams, best_speculation
from specray.engine.intake import ContextLengthError, check_context_length, encode_prompt
from specray.policies.registry import Limits, parse_speculation, validate_speculation
from specray.protocol import openai as P
from specray.protocol import tools
from specray.protocol.tools import ToolPlan

MAX_REPORTED = 10  # problems listed in one message; the rest are counted


class RequestError(ValueError):
    """A bad request: every problem found, as (param, message) pairs (HTTP 400)."""

    def __init__(self, problems: list[tuple[str | None, str]]):
        # A field name may itself be broken Unicode: every answer must encode as UTF-8.
        self.problems = [(None if p is None else _printable(p), _printable(m)) for p, m in problems]
        shown = self.lines()[:MAX_REPORTED]
        more = len(problems) - len(shown)
        super().__init__("; ".join(shown) + (f"; and {more} more" if more > 0 else ""))

    def lines(self) -> list[str]:
        """Each problem as one line, starting with the field it is about."""
        return [f"{param}: {msg}" if param and not msg.startswith(param) else msg for param, msg in self.problems]

    @property
    def param(self) -> str | None:
        return self.problems[0][0] if self.problems else None


@dataclass
class Facts:
    """What checking needs from the model (read once: by the ingress at start, by a batch job
    per file)."""

    tokenizer: Any
    context: int
    vocab_size: int
    limits: Limits
    default_speculation: Any
    tool_parser: str | None = None  # auto tool choice's parser (--tool-call-parser); None: auto is off
    _grammars: Any = field(default=None, repr=False)

    @property
    def grammars(self):
        """Structured outputs' compiled grammars for this tokenizer (``engine/grammar.py``)."""
        if self._grammars is None:
            from specray.engine.grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.vocab_size, getattr(self.tokenizer, "eos_token_id", None))
        return self._grammars

    @cached_property
    def special_tokens(self) -> frozenset[str]:
        """The tokenizer's special tokens (``tools.special_tokens``): read once, not per request."""
        return tools.special_tokens(self.tokenizer)


def facts_for(config, tokenizer, tool_parser: str | None = None) -> Facts:
    """Facts of a SpecrayConfig whose target is set (read from its files, no weights loaded);
    ``tool_parser``: auto tool choice's (``ServeConfig.auto_tool_parser``), None where it is off."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(config.target)
    context = config.engine_config().context_length(model_config)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    limits = Limits(capacity=context, vocab_size=text.vocab_size, methods=config.method_facts())
    return Facts(tokenizer, context, text.vocab_size, limits,
                 config.default_speculation or best_speculation(limits.methods), tool_parser)


def validation_problems(exc: ValidationError, prefix: str = "") -> list[tuple[str | None, str]]:
    """Every error of a pydantic validation, as (param, message) ("Value error, " dropped; broken
    Unicode is ``unicode_problems``' to report)."""
    out = []
    for err in exc.errors():
        if err["type"] == "string_unicode":
            continue
        cause = (err.get("ctx") or {}).get("error")
        at = (*err["loc"], cause.param) if isinstance(cause, P.FieldError) else err["loc"]
        loc = ".".join(str(p) for p in at) or None
        msg = err["msg"].removeprefix("Value error, ")
        out.append((f"{prefix}{loc}" if loc else None, f"{prefix}{loc}: {msg}" if loc else msg))
    return out


def unicode_problems(body, prefix: str = "") -> list[tuple[str | None, str]]:
    """Every string of a parsed JSON body (keys too) that is not valid Unicode: JSON's
    ``"\\ud800"`` escape decodes to a lone surrogate, which no tokenizer can encode. Walked
    without recursion (a body may nest thousands of levels)."""
    problems, stack = [], [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in reversed(value.items()))
            for key in (k for k in value if isinstance(k, str) and not _utf8(k)):
                param = f"{prefix}{'.'.join(map(str, (*path, key)))}"
                problems.append((param, f"{param}: the field name is not valid Unicode (a lone surrogate)"))
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, str) and not _utf8(value):
            param = f"{prefix}{'.'.join(map(str, path))}"
            at = next(i for i, c in enumerate(value) if "\ud800" <= c <= "\udfff")
            problems.append((param, f"{param}: not valid Unicode: a lone surrogate "
                                    f"(\\u{ord(value[at]):04x}) at character {at}; send UTF-8 text"))
    return problems


def _printable(text: str) -> str:
    return text if _utf8(text) else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse(body: dict, chat: bool, prefix: str = "", facts: Facts | None = None):
    """The request model of a body (RequestError listing every field's error, and — with
    ``facts`` — whether its speculation can run here, so that one answer says both)."""
    model = P.ChatCompletionRequest if chat else P.CompletionRequest
    broken = unicode_problems(body, prefix)
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        problems = broken + validation_problems(exc, prefix)
        if facts is not None and body.get("speculation") is not None and not any(
                (p or "").startswith(f"{prefix}speculation") for p, _ in problems):
            try:
                problems += _speculation_problems(parse_speculation(body["speculation"]), facts, prefix)
            except ValueError:  # not even its method's options: pydantic has said so already
                pass
        raise RequestError(problems) from None
    if broken:
        raise RequestError(broken)
    return req


def _speculation_problems(options, facts: Facts, prefix: str) -> list[tuple[str, str]]:
    try:
        validate_speculation(options, facts.limits)
    except ValueError as exc:
        message = str(exc)
        about_method = "method" in message.split(":")[0] or "unknown speculation method" in message
        param = f"{prefix}speculation{'.method' if about_method else ''}"
        return [(param, f"{param}: {message}")]
    return []


def _token_id_problems(req, facts: Facts, prefix: str) -> list[tuple[str, str]]:
    """Token ids a request names besides its prompt must be the model's."""
    problems = []
    for name, ids in req.named_token_ids().items():
        bad = [t for t in ids if not 0 <= t < facts.vocab_size]
        if bad:
            param = f"{prefix}{name}"
            problems.append((param, f"{param}: token ids must lie in [0, {facts.vocab_size}); got {bad[:5]}"))
    return problems


@dataclass(frozen=True)
class Checked:
    """A request ready to run: per prompt, its text or ids, its token ids and the sampling
    of each of its ``n`` choices (choice index = prompt index x n + j, as OpenAI numbers them)."""

    prompts: list[str | list[int]]
    prompt_ids: list[list[int]]
    samplings: list[list[SamplingParams]]
    speculation: dict | None
    prompt_only: bool = False  # max_tokens 0 with echo: score the prompt, generate nothing (``P.prompt_only``)
    tools: ToolPlan | None = None  # how the reply is read for tool calls (chat; ``protocol/tools.py``)


def _grammar_problems(req, facts: Facts, prefix: str) -> list[tuple[str, str]]:
    """A structured output that cannot be compiled, or that no allowed token can start."""
    from specray.engine.grammar import GrammarError

    constraint = req.constraint()
    if constraint is None:
        return []
    param = f"{prefix}{req.constraint_field()}"
    try:
        grammar = facts.grammars.source(constraint.kind, constraint.value)
        if req.allowed_token_ids:
            first = facts.grammars.matcher(grammar, frozenset()).allowed([0], [-1])[0]
            if not first[[t for t in req.allowed_token_ids if 0 <= t < facts.vocab_size]].any():
                return [(f"{prefix}allowed_token_ids", f"{prefix}allowed_token_ids: none of them can start the "
                                                      f"output {param} asks for")]
    except GrammarError as exc:
        return [(param, f"{param}: {exc}")]
    return []


def check(req, chat: bool, facts: Facts, default_max_tokens: int, prefix: str = "") -> Checked:
    """Check a parsed request against the model; RequestError with every problem."""
    problems: list[tuple[str | None, str]] = []
    field = f"{prefix}{'messages' if chat else 'prompt'}"
    if chat:
        tok = facts.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError([(field, f"{field}: this model has no chat template; use /v1/completions")])
        try:
            prompts = [req.render(tok)]
        except Exception as exc:  # noqa: BLE001 - the template (jinja) refused these messages
            raise RequestError([(field, f"{field}: the model's chat template failed on them: "
                                        f"{type(exc).__name__}: {exc}")]) from None
    else:
        prompts = req.prompts()
    ids_per_prompt, samplings = [], []
    for number, prompt in enumerate(prompts):
        where = f"{field}" if len(prompts) == 1 else f"{field}.{number}"
        try:
            ids = encode_prompt(prompt, facts.tokenizer, req.special_tokens())
        except ValueError as exc:
            problems.append((field, f"{where}: {exc}"))
            continue
        if req.truncate_prompt_tokens is not None and len(ids) > req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens:]  # vLLM's: the prompt's last N tokens
            prompts[number] = ids  # what an echo shows
        if not ids:
            problems.append((field, f"{where}: the prompt is empty"))
            continue
        if min(ids) < 0 or max(ids) >= facts.vocab_size:
            problems.append((field, f"{where}: prompt token ids must lie in [0, {facts.vocab_size})"))
            continue
        try:
            check_context_length(len(ids), None, facts.context)
            max_tokens = P.resolve_max_tokens(req, len(ids), facts.context, default_max_tokens, chat)
        except ContextLengthError as exc:
            param = field if exc.max_tokens is None else f"{prefix}{req.requested_max_tokens()[0]}"
            problems.append((param, f"{where}: {exc}" if exc.max_tokens is None else str(exc)))
            continue
        ids_per_prompt.append(ids)
        if req.min_tokens > max(max_tokens, 1):
            param = f"{prefix}min_tokens"
            if not any(p == param for p, _ in problems):
                problems.append((param, f"{param}: {req.min_tokens} exceeds the {max_tokens} tokens the request "
                                        "may generate"))
            continue
        try:
            # Prompt scoring (max_tokens 0) runs the prefill, which samples one token; it is dropped.
            samplings.append([req.sampling(max(max_tokens, 1), number * req.n + j) for j in range(req.n)])
        except ValidationError as exc:
            problems.extend(validation_problems(exc, prefix))
    prompt_only = req.max_tokens == 0
    if prompt_only and not req.echo_prompt():
        problems.append((f"{prefix}max_tokens", f"{prefix}max_tokens: 0 only scores a prompt: it needs echo "
                                                "(completions), else at least 1"))
    problems += _token_id_problems(req, facts, prefix)
    problems += _grammar_problems(req, facts, prefix)
    problems += _speculation_problems(req.speculation or facts.default_speculation, facts, prefix)
    plan = None
    if chat:
        if (problem := tools.auto_problem(req, facts.tool_parser)) is not None:
            problems.append((f"{prefix}tool_choice", f"{prefix}tool_choice: {problem}"))
        plan = tools.plan_for(req, facts.tool_parser)
    if problems:
        raise RequestError(problems)
    if plan is not None and plan.keeps_special_tokens(facts.special_tokens):
        samplings = [[s.model_copy(update={"skip_special_tokens": False}) for s in row] for row in samplings]
    spec = req.speculation.model_dump() if req.speculation else None
    return Checked(prompts, ids_per_prompt, samplings, spec, prompt_only, plan)
