"""Per-request parameters, validated at the edge (pydantic): sampling and speculation."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop (vLLM's names and defaults).

    >>> SamplingParams(max_tokens=32, temperature=0)      # greedy
    SamplingParams(max_tokens=32, temperature=0.0, ...)   # doctest: +SKIP
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept, in (0, 1].")
    top_k: int = Field(0, ge=-1, description="Keep the k most likely tokens; 0 or -1 = off.")
    seed: int | None = Field(None, description="Per-request RNG seed (reproducible sampling).")
    stop: list[str] = Field(default_factory=list, description="Stop strings (not included in text).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")

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


class SpeculationParams(BaseModel):
    """Per-request speculation: which proposer and how many tokens it guesses per step.

    ``method`` names a registered proposer (``specray.policies``): ``none``, ``draft``,
    ``ngram`` (prompt lookup), ...
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str = Field("none", description="Proposer name, or 'none' for plain decoding.")
    num_speculative_tokens: int = Field(
        4, ge=1, le=64, description="Draft tokens per step (k); prompt_lookup_num_tokens for ngram."
    )
    max_matching_ngram_size: int = Field(
        2, ge=1, le=16, description="Prompt lookup: longest tail n-gram matched first."
    )
    medusa_choices: list[list[int]] | None = Field(
        None, description="Medusa tree: every candidate, or only the unique paths (TensorRT-LLM's two forms)."
    )
    tree: str | None = Field(None, description="Medusa: a named tree (chain, trtllm_example, wide).")
    acceptance: Literal["exact", "typical"] = Field(
        "exact",
        description="exact: token match / rejection sampling (lossless). typical: Medusa's typical "
        "acceptance for tree methods at temperature > 0 (LOSSY, faster).",
    )
    posterior_threshold: float = Field(0.09, gt=0, le=1, description="Typical acceptance: hard threshold.")
    posterior_alpha: float = Field(0.3, gt=0, le=1, description="Typical acceptance: entropy factor.")

    @field_validator("medusa_choices")
    @classmethod
    def _valid_tree(cls, v):
        if v is not None:
            from specray.kernels.tree import normalize_choices

            normalize_choices(v)  # TreeError (a ValueError) names what is wrong
        return v

    @field_validator("tree")
    @classmethod
    def _known_tree(cls, v):
        from specray.kernels.tree import NAMED_TREES

        if v is not None and v not in NAMED_TREES:
            raise ValueError(f"unknown tree {v!r}; named trees: {sorted(NAMED_TREES)}")
        return v

