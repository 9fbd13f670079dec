"""A request's state in the engine and the outputs it streams.

Stopping is decided here, token by token, so a step that accepts several tokens stops
exactly where plain decoding would have: EOS / stop token ids (kept in ``token_ids``),
``max_tokens``, the context limit, and stop strings (cut from ``text``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specray.engine.metrics import SpecMetrics
from specray.engine.params import SamplingParams
from specray.policies.registry import MethodOptions


DETOKENIZE_CONTEXT = 8  # tokens of context an incremental decode may keep before moving up


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for a request (and, once finished, its completion)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    new_token_ids: list[int]  # generated in this step
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    metrics: dict
    step: dict | None = None  # what this step's speculation did (``speculation_event``)
    error: str | None = None  # finish_reason "error": what raised
    logprobs: list[dict] | None = None  # every generated token's so far, when asked (``engine/logprobs.py``)
    prompt_logprobs: list[dict | None] | None = None  # the prompt's, when asked


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    speculation: MethodOptions
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    slot: int = -1
    admitted: int = -1  # admission order (the scheduler's): the newest is preempted first
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    logprobs: list[dict] | None = None  # entries of the kept tokens, when sampling.logprobs asks
    prompt_logprobs: list[dict | None] | None = None
    row_view: object = field(default=None, repr=False, compare=False)  # the controller's view (``step.row_view``)
    grammar_source: str | None = None  # structured outputs: the checked grammar (``engine/grammar.py``)
    grammar: object = field(default=None, repr=False, compare=False)  # its matcher, where the steps run
    _prefix_offset: int = 0  # incremental detokenisation (``_decode_new``)
    _read_offset: int = 0
    _prefix_text: str | None = None  # the text of output_ids[_prefix_offset:_read_offset], when known

    def __getstate__(self):  # a matcher stays in its process: the engine that receives a request makes its own
        return {**self.__dict__, "grammar": None}

    @property
    def method(self) -> str:
        return self.speculation.method

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_ids(self) -> list[int]:
        """What prefill runs through the target: the prompt, or — a request resumed on a new
        worker with tokens already emitted — everything but its last token (the root)."""
        return self.token_ids[:-1] if self.output_ids else self.prompt_ids

    def resumed(self, output_ids: Sequence[int], tokenizer, metrics: SpecMetrics, generator) -> "Request":
        """This request as it stood after ``output_ids``, to continue on another worker."""
        out = Request(self.request_id, self.prompt_ids, self.sampling, self.speculation, self.stop_ids,
                      generator=generator, output_ids=list(output_ids), metrics=metrics,
                      grammar_source=self.grammar_source)
        if tokenizer is not None and output_ids:
            out.text = out._decode(tokenizer, out.output_ids)
            out._prefix_offset, out._read_offset = len(output_ids) - 1, len(output_ids)
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.output_ids)

    def append(self, tokens: Sequence[int], capacity: int, tokenizer, logprobs: list[dict] | None = None) -> list[int]:
        """Append emitted tokens until a stop condition; return the ones kept (``logprobs``:
        the emitted tokens' entries; those of the kept ones are recorded)."""
        kept: list[int] = []
        for tok in tokens:
            if self.grammar is not None and not self.grammar.advance(int(tok)):
                self.finish_reason = "stop"  # nothing the grammar allows was left to sample
                break
            self.output_ids.append(int(tok))
            kept.append(int(tok))
            if int(tok) in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.sampling.max_tokens or self.num_tokens >= capacity:
                self.finish_reason = "length"
            elif self.grammar is not None and self.grammar.ended:
                self.finish_reason = "stop"  # the grammar is complete and there is no stop token to end on
            if self.finished:
                break
        if tokenizer is not None:
            kept = self._update_text(kept, tokenizer)  # a stop string may drop tokens
        if logprobs is not None and self.sampling.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(logprobs[: len(kept)])
        self.metrics.num_generated_tokens = len(self.output_ids)
        return kept

    def _update_text(self, kept: list[int], tokenizer) -> list[int]:
        before = len(self.text)
        text = self.text + self._decode_new(tokenizer)
        stops = self.sampling.stop
        least = self.sampling.min_tokens  # stop strings count once a token past the first min_tokens ends them
        if stops and len(self.output_ids) > least:
            longest = max(len(s) for s in stops)
            start = max(0, before - longest + 1)
            floor = len(self._decode(tokenizer, self.output_ids[:least])) if least else 0
            hits = [_find_ending_after(text, s, start, floor) for s in stops]
            hits = [(i, s) for i, s in zip(hits, stops) if i >= 0]
            if hits:
                cut, stop = min(hits)
                # Keep the fewest tokens whose text reaches the stop string.
                first_new = len(self.output_ids) - len(kept)
                for n in range(max(first_new, least) + 1, len(self.output_ids) + 1):
                    if _find_ending_after(self._decode(tokenizer, self.output_ids[:n]), stop, start, floor) >= 0:
                        break
                dropped = len(self.output_ids) - n
                del self.output_ids[n:]
                kept = kept[: len(kept) - dropped]
                self.finish_reason = "stop"
                text = text[: cut + len(stop)] if self.sampling.include_stop_str_in_output else text[:cut]
        if self.finish_reason not in (None, "stop"):
            text += self._decode_new(tokenizer, final=True)  # an incomplete character at the end
        self.text = text
        return kept

    def _decode_new(self, tokenizer, final: bool = False) -> str:
        """Text of the tokens since the last call (vLLM's incremental detokenisation: decode
        from a few tokens back, for context, and hold back a trailing incomplete character),
        so a step costs what it adds, and the text only ever grows. The context's start stays
        put until it lies ``DETOKENIZE_CONTEXT`` tokens back, so that the last call's text is
        this call's prefix: one decode a step, not two (a decode costs its call more than its
        few extra tokens)."""
        ids = self.output_ids
        prefix = self._prefix_text
        if prefix is None:
            prefix = self._decode(tokenizer, ids[self._prefix_offset : self._read_offset])
        full = self._decode(tokenizer, ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            self._prefix_text = prefix
            return ""
        if self._read_offset - self._prefix_offset >= DETOKENIZE_CONTEXT:
            self._prefix_offset, self._prefix_text = self._read_offset, None
        else:
            self._prefix_text = full
        self._read_offset = len(ids)
        return full[len(prefix) :]

    def _decode(self, tokenizer, ids: Sequence[int]) -> str:
        s = self.sampling
        if s.spaces_between_special_tokens:  # the default: every tokenizer's own
            backend = _backend_decoder(tokenizer)
            if backend is not None:
                return backend.decode(ids, skip_special_tokens=s.skip_special_tokens)
            return tokenizer.decode(ids, skip_special_tokens=s.skip_special_tokens)
        return tokenizer.decode(ids, skip_special_tokens=s.skip_special_tokens, spaces_between_special_tokens=False)

    def fail(self, message: str) -> None:
        """Finish with 'error': something raised while serving this request (only this one)."""
        self.finish_reason, self.error = "error", message

    def output(self, new_tokens: list[int], step: dict | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            new_token_ids=new_tokens,
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            metrics=self.metrics.to_dict(),
            step=step,
            error=self.error,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
        )


@functools.lru_cache(maxsize=16)
def _backend_decoder(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer whose ``decode``
    returns that tokenizer's decode unchanged (neither decode step overridden, no clean-up of
    spaces), else None. A step decodes twice per row (``_decode_new``), and calling the
    backend skips transformers' Python layers around it."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (cls.decode is not PreTrainedTokenizerBase.decode or getattr(cls, "_decode", None) is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return getattr(tokenizer, "_tokenizer", None)


def _find_ending_after(text: str, stop: str, start: int, floor: int) -> int:
    """The first occurrence of ``stop`` in ``text`` from ``start`` that ends past ``floor``; -1 if none."""
    at = text.find(stop, max(start, floor - len(stop) + 1))
    return at


def speculation_event(method: str, drafted: list[int], rejected: list[int], num_accepted: int,
                      kept: list[int], num_drafted: int) -> dict:
    """One step of one request, for people watching speculation (streams, the playground).

    drafted:  the draft's main line (a chain; for a tree, its accepted path then the
              top-ranked continuation below it); num_drafted counts every node verified
    accepted: the draft tokens the target kept (as emitted: stop conditions may cut them)
    rejected: the drafted tokens after the last accepted one on the main line
    bonus:    the target's own token this step (recovered at a mismatch, or the bonus after
              a fully accepted draft); None if a stop condition cut it
    """
    accepted = kept[:num_accepted]
    bonus = kept[num_accepted] if len(kept) > num_accepted else None
    return {
        "method": method,
        "num_drafted": num_drafted,
        "drafted": drafted,
        "accepted": accepted,
        "rejected": rejected,
        "bonus": bonus,
        "recovered": bool(rejected),
    }
