"""Per-request parameters, validated at the edge (pydantic): sampling and speculation."""

from __future__ import annotations

from typing import Annotated, Iterable

from pydantic import (BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema, field_validator,
                      model_validator)

import specray.policies  # noqa: F401  (registers every method)
from specray.policies.registry import MethodOptions, PlainOptions, parse_speculation

# What a request that names no method gets: the first of these the loaded weights allow. A
# draft model first (the demo pair's draft accepts ~3.5 tokens per step at the lowest cost per
# drafted token), then trained heads (EAGLE-3, the newest, reads three target layers; then EAGLE >
# ReDrafter > Medusa on the demo target's trained heads: README "Results"), then prompt lookup,
# which needs nothing and costs no forward. Only ``method`` is set, so the self-tuning
# controller picks the length (k = 0 when it does not pay).
DEFAULT_METHOD_ORDER = ("draft", "eagle3", "eagle", "redrafter", "medusa", "ngram")


class StructuredOutputs(BaseModel):
    """Constrain the output to a grammar (vLLM's ``structured_outputs``): exactly one of the
    kinds. The output is what the target samples with its logits masked to the grammar at
    each token, under every speculative method (``engine/grammar.py``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, serialize_by_alias=True)

    json_: dict | str | None = Field(None, alias="json", description="A JSON schema the output matches.")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, min_length=1, description="The output is one of these strings.")
    grammar: str | None = Field(None, description="A context-free grammar: Lark, or GBNF (``::=``).")
    json_object: bool | None = Field(None, description="Any JSON object.")
    structural_tag: dict | str | None = Field(
        None, description="vLLM's structural tag: free text where each structure's begin opens JSON of its schema "
        "up to its end ({'structures': [{'begin', 'schema', 'end'}], 'triggers': [...]}).")

    @field_validator("choice")
    @classmethod
    def _nonempty_choices(cls, v):
        if v is not None and any(c == "" for c in v):
            raise ValueError("choices must be non-empty strings")
        return v

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k, v in self.constraint_fields().items() if v not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object, structural_tag"
                             + (f"; got {', '.join(given)}" if given else ""))
        return self

    def constraint_fields(self) -> dict:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object, "structural_tag": self.structural_tag}

    @property
    def kind(self) -> str:
        return next(k for k, v in self.constraint_fields().items() if v not in (None, False))

    @property
    def value(self):
        return self.constraint_fields()[self.kind]


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
    # What changes the target's distribution (``engine/logits.py``; speculation keeps it exactly).
    min_tokens: int = Field(0, ge=0, description="Generate at least this many tokens: the stop token ids (EOS "
                            "unless ignore_eos, stop_token_ids) are held back and stop strings not matched until then.")
    repetition_penalty: float = Field(1.0, gt=0.0, description="Divide (positive) or multiply (negative) the logits "
                                      "of tokens in the prompt or the output; 1 = off.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtract from the logits of tokens in the output.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtract, per occurrence in the output.")
    logit_bias: dict[int, float] | None = Field(None, description="token id -> bias added to its logit, in [-100, 100].")
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="Sample only these tokens.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p x the most likely one "
                         "(after temperature); 0 = off.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Constrain the output to a JSON schema, regex, choice or grammar.")
    # How text is made of the tokens.
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    spaces_between_special_tokens: bool = Field(True, description="(Tokenizers that take it.) Spaces around them.")
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended the text.")

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

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v):
        if v and any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("biases must lie in [-100, 100]")
        return v

    @model_validator(mode="after")
    def _min_below_max(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def named_token_ids(self) -> list[int]:
        """Every token id these parameters name (each must be the model's)."""
        return [*self.stop_token_ids, *(self.logit_bias or ()), *(self.allowed_token_ids or ())]

    @property
    def processes_logits(self) -> bool:
        """Does sampling read other logits than the target's own (``engine/logits.py``)?"""
        return bool(self.min_tokens or self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.allowed_token_ids is not None
                    or self.structured_outputs is not None)

    @property
    def penalized(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)

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
