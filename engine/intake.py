"""Where a request enters: validated and tokenised once into a ``Request`` record.

Pure CPU code, no models. The in-process engine makes its requests here (``add_request``);
the Ray coordinator makes them here and sends the record to its engine worker, whose
scheduler only schedules.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

import torch

from specray.engine.grammar import Grammars
from specray.engine.params import SamplingParams, best_speculation
from specray.engine.request import Request
from specray.policies.registry import Limits, MethodOptions, validate_speculation


class ContextLengthError(ValueError):
    """A request that cannot fit the model's context: its prompt alone, or its prompt plus
    the max_tokens it asks for (HTTP 400, as vLLM and OpenAI answer)."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, context: int):
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context
        if max_tokens is None:
            message = (f"prompt has {prompt_tokens} tokens; the model's context is {context} tokens "
                       "and generation needs at least one more")
        else:
            message = (f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in "
                       "the completion). Please reduce the length of the prompt or max_tokens.")
        super().__init__(message)

    def __reduce__(self):  # picklable across Ray with its own arguments, not the message
        return type(self), (self.prompt_tokens, self.max_tokens, self.context)


def check_context_length(prompt_tokens: int, max_tokens: int | None, context: int) -> None:
    """Raise ContextLengthError unless the prompt leaves room for a token and, when
    max_tokens is given, prompt_tokens + max_tokens <= context."""
    if prompt_tokens >= context:
        raise ContextLengthError(prompt_tokens, None, context)
    if max_tokens is not None and prompt_tokens + max_tokens > context:
        raise ContextLengthError(prompt_tokens, max_tokens, context)


def encode_prompt(prompt: str | Sequence[int], tokenizer, add_special_tokens: bool = False) -> list[int]:
    """A prompt's token ids as the engine counts them (text needs the tokenizer; its special
    tokens, e.g. BOS, only when asked: the engine's own API never adds them)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return [int(t) for t in prompt]


class RequestMaker:
    """Makes ``Request`` records for one engine's limits.

    strict_context: refuse (ContextLengthError) a request whose prompt + max_tokens
    exceeds the context; otherwise such a request runs until the context is full and
    finishes with 'length'. A prompt that leaves no room is refused either way.
    """

    def __init__(self, limits: Limits, tokenizer=None, default_speculation: MethodOptions | None = None,
                 strict_context: bool = False):
        self.limits = limits
        self.tokenizer = tokenizer
        # Requests that name no method get the best one these models allow (params.best_speculation).
        self.default_speculation = default_speculation or best_speculation(limits.methods)
        self.strict_context = strict_context
        self._ids = itertools.count()
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos not in limits.eos_ids:
            eos = min(limits.eos_ids, default=None)
        self.grammars = Grammars(tokenizer, limits.vocab_size, eos)  # structured outputs, compiled on first use

    def make(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        speculation: MethodOptions | None = None,
        request_id: str | None = None,
    ) -> Request:
        """Validate and build a request (ValueError with a clear message if bad;
        ContextLengthError if it cannot fit the context)."""
        sampling = sampling or SamplingParams()
        speculation = speculation or self.default_speculation
        validate_speculation(speculation, self.limits)
        prompt_ids = encode_prompt(prompt, self.tokenizer)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        check_context_length(len(prompt_ids), sampling.max_tokens if self.strict_context else None,
                             self.limits.capacity)
        vocab = self.limits.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        named = [t for t in sampling.named_token_ids() if not 0 <= t < vocab]
        if named:
            raise ValueError(f"token ids in the sampling parameters must lie in [0, {vocab}); got {named[:5]}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        generator = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.limits.eos_ids)
        grammar, compile_s = None, None
        if sampling.structured_outputs is not None:
            start = time.perf_counter()
            grammar = self.grammars.source(sampling.structured_outputs.kind, sampling.structured_outputs.value)
            compile_s = time.perf_counter() - start
        request = Request(request_id, prompt_ids, sampling, speculation, stop_ids, generator=generator,
                          grammar_source=grammar)
        request.metrics.grammar_compile_s = compile_s
        return request
