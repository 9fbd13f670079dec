"""Engine configuration: plain frozen dataclasses (pydantic lives at the user edge)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

import torch

from specray.policies.registry import MethodOptions, PlainOptions
from specray.policies.spec_length import SpeculationLengthPolicy

log = logging.getLogger(__name__)

STEP_CHOICES = ("auto", "eager", "static", "compile", "graphs")

# Without an explicit max_model_len, contexts are capped here: the KV cache is
# preallocated for max_num_seqs x context tokens.
DEFAULT_CONTEXT_CAP = 4096


@dataclass(frozen=True)
class EngineConfig:
    """Which models, where, and how many sequences at once.

    target/draft/tokenizer: Hugging Face checkpoint directories (or hub ids when online).
        The entry points (CLI, Serve builder, jobs, the Coordinator's config) put the
        built-in demo pair here when no target is given; the engine itself builds nothing.
    medusa: a Medusa heads directory (public layout) for method 'medusa'.
    checkpoints: weights of other methods, by their spec's checkpoint key (e.g. "eagle").
    max_num_seqs: rows of the batch (KV cache slots).
    max_model_len: context per sequence; default min(model max positions, 4096).
    step: how a step runs (``engine/graphs.py``): ``eager`` (HF modules as they are, host
        acceptance: the reference), ``static`` (fixed shapes, acceptance on the device, one
        read-back per step), ``compile`` (the same under torch.compile), ``graphs`` (the
        same captured as CUDA graphs), ``auto`` (graphs on CUDA, eager on CPU).
    default_speculation: for requests that do not say.
    speculation_length: static caps of k by running batch size (off above a batch size),
        whatever requests ask for; None (default) = the self-tuning controller
        (``policies/controller.py``), which learns each step's k from measured acceptance
        and step costs (k = 0 when speculation does not pay).
    """

    target: str | None = None
    draft: str | None = None
    tokenizer: str | None = None
    medusa: str | None = None
    checkpoints: Mapping[str, str] = field(default_factory=dict)
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 8
    max_model_len: int | None = None
    step: str = "auto"
    default_speculation: MethodOptions = field(default_factory=PlainOptions)
    speculation_length: SpeculationLengthPolicy | None = None

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r} (e.g. float32, bfloat16, float16)")
        if self.step not in STEP_CHOICES:
            raise ValueError(f"unknown step {self.step!r}: one of {', '.join(STEP_CHOICES)}")
        if self.speculation_length is not None and not callable(getattr(self.speculation_length, "caps", None)):
            raise TypeError(f"speculation_length must be None (self-tuning) or a policy with caps(), such as "
                            f"SpeculationLengthPolicy(); got {self.speculation_length!r}")

    def step_mode(self, device: torch.device) -> str:
        """The step mode this config runs on ``device`` (``auto`` resolved)."""
        if self.step == "auto":
            return "graphs" if device.type == "cuda" else "eager"
        if self.step == "graphs" and device.type != "cuda":
            raise ValueError("step 'graphs' captures CUDA graphs and needs a CUDA device; on CPU use "
                             "'compile' (or 'static', or 'eager')")
        return self.step

    def require_target(self) -> str:
        if self.target is None:
            raise ValueError("EngineConfig.target is required (the built-in demo pair: "
                             "specray.demo.load_or_build_demo_pair().target)")
        return self.target

    def checkpoint(self, key: str) -> str | None:
        """The directory of a method's weights (``MethodSpec.checkpoint``), if configured."""
        return {"draft": self.draft, "medusa": self.medusa, **self.checkpoints}.get(key)

    def load_model(self, path: str):
        from specray.engine.runner import load_model

        return load_model(path, self.dtype, self.device)

    def context_length(self, model_config) -> int:
        cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        limit = getattr(cfg, "max_position_embeddings", None) or DEFAULT_CONTEXT_CAP
        if self.max_model_len is None:
            return min(limit, DEFAULT_CONTEXT_CAP)
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {limit} positions")
        return self.max_model_len


def load_tokenizer(path: str | None):
    """The checkpoint's tokenizer, or None if it has none (prompts are then token ids)."""
    if path is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        log.info("no tokenizer at %s: prompts must be token ids", path)
        return None
