"""Per-request parameters, validated at the edge (pydantic): sampling and speculation."""

from __future__ import annotations

from typing import Annotated, Iterable

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema, field_validator

import specray.policies  # noqa: F401  (registers every method)
from specray.policies.registry import MethodOptions, PlainOptions, parse_speculation

# What a request that names no method gets: the first of these the loaded weights allow. A
# draft model first (the demo pair's draft accepts ~3.5 tokens per step at the lowest cost per
# drafted token), then trained heads (EAGLE-3, the newest, reads three target layers; then EAGLE >
# ReDrafter > Medusa on the demo target's trained heads: README "Results"), then prompt lookup,
# which needs nothing and costs no forward. Only ``method`` is set, so the self-tuning
# controller picks the length (k = 0 when it does not pay).
DEFAULT_METHOD_ORDER = ("draft", "eagle3", "eagle", "redrafter", "medusa", "ngram")


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop (vLLM's names and defaults).

    >>> SamplingParams(max_tokens=32, temperature=0)      # greedy
    SamplingParams(max_tokens=32, temperature=0.0, ...)   # doctest: +SKIP
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept, in (0, 1].")
    top_k: int = Field(0, ge=-1, le=2**63 - 1, description="Keep the k most likely tokens; 0 or -1 = off.")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1,
                             description="Per-request RNG seed (reproducible sampling; torch takes 64 bits).")
    stop: list[str] = Field(default_factory=list, description="Stop strings (not included in text).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Return each generated token's log-probability under the target's raw "
        "distribution and this many most likely alternatives (0: the token's own only); None = none.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="The same for every prompt token after the first (OpenAI's echo).")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v):
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _nonempty_stops(cls, v):
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int:
        return max(self.top_k, 0)


def SpeculationParams(**fields) -> MethodOptions:  # noqa: N802 (reads like the model it builds)
    """Per-request speculation: the options model of ``fields["method"]`` (default ``none``).

    Each registered method has its own options (``specray.policies``); unknown fields of
    that method are errors. ``SpeculationParams(method="draft", num_speculative_tokens=4)``
    is a ``DraftOptions``.
    """
    return parse_speculation(fields)


Speculation = Annotated[
    MethodOptions,
    PlainValidator(parse_speculation),
    PlainSerializer(lambda v: v.model_dump(), return_type=dict),
    WithJsonSchema({"type": "object", "description": "speculation options, discriminated by 'method'"}),
]
"""A pydantic field type for a request's ``speculation``: a discriminated union on ``method``
over the registered methods' options models (methods registered later join it)."""


def best_speculation(available: Iterable[str]) -> MethodOptions:
    """The default speculation where ``available`` methods can run (``Limits.methods``).

    >>> best_speculation(["none", "ngram", "draft"]).method
    'draft'
    """
    available = set(available)
    for name in DEFAULT_METHOD_ORDER:
        if name in available:
            return parse_speculation({"method": name})
    return PlainOptions()
