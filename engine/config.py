"""Engine configuration: plain frozen dataclasses (pydantic lives at the user edge)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping

import torch

from specray.engine.capture import CaptureConfig
from specray.policies.registry import MethodOptions
from specray.policies.spec_length import SpeculationLengthPolicy

log = logging.getLogger(__name__)

STEP_CHOICES = ("auto", "eager", "static", "compile", "cudagraph", "graphs")
# What ``step: auto`` runs on a CPU for a server (which compiles while it warms up, before it
# says ready). A one-shot run (``specray generate``) stays eager whatever this says: the
# compile costs it more than it gains (``one_shot_step``).
CPU_AUTO_STEP = "eager"

# Without an explicit max_model_len, contexts are capped here: the KV cache is
# preallocated for max_num_seqs x context tokens.
DEFAULT_CONTEXT_CAP = 4096
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" where this process sees a GPU, else "cpu"; others as given
    ("cuda:1" included). Checked where models load: a coordinator may see no GPU at all."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> bfloat16 on CUDA (what checkpoints are trained in, half the memory of
    float32), float32 on CPU (CPU bf16 matmuls are slow and lossy here); others as given."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolve_device(device).startswith("cuda") else "float32"


def check_device(device: str, flag: str = "--device") -> None:
    """ValueError (one line, naming the flag) unless models can load on ``device`` here."""
    if device not in DEVICES and not device.startswith("cuda:"):
        raise ValueError(f"{flag} {device}: use one of {', '.join(DEVICES)} (or cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{flag} {device}: CUDA is not available to torch {torch.__version__} on this machine; "
                         f"use {flag} cpu (or auto)")


@dataclass(frozen=True)
class EngineConfig:
    """Which models, where, and how many sequences at once.

    target/draft/tokenizer: Hugging Face checkpoint directories (or hub ids when online).
        The entry points (CLI, Serve builder, jobs, the Coordinator's config) put the
        built-in demo pair here when no target is given; the engine itself builds nothing.
    medusa: a Medusa heads directory (public layout) for method 'medusa'.
    checkpoints: weights of other methods, by their spec's checkpoint key (e.g. "eagle").
    dtype: float32 | bfloat16 | float16 | auto (bfloat16 on CUDA, float32 on CPU).
    device: cpu | cuda[:N] | auto (CUDA where this process sees a GPU).
    max_num_seqs: rows of the batch (KV cache slots).
    max_model_len: context per sequence; default min(model max positions, 4096).
    step: how a step runs (``engine/graphs.py``): ``eager`` (HF modules as they are, host
        acceptance: the reference), ``static`` (fixed shapes, acceptance on the device, one
        read-back per step), ``compile`` (the same under torch.compile), ``cudagraph`` (static
        captured as CUDA graphs), ``graphs`` (compiled and captured), ``auto`` (graphs on CUDA,
        eager on CPU).
    default_speculation: for requests that do not say; None (default) = the best method
        the loaded weights allow (``params.best_speculation``: draft, then heads, then
        prompt lookup), its length left to the self-tuning controller.
    speculation_length: static caps of k by running batch size (off above a batch size),
        whatever requests ask for; None (default) = the self-tuning controller
        (``policies/controller.py``), which learns each step's k from measured acceptance
        and step costs (k = 0 when speculation does not pay).
    online_learning: capture for online learning (``engine/capture.py``) and versioned
        drafters that can be swapped between steps (``engine/drafter_versions.py``); None
        (default): neither.
    warm_up: under a compiled step, compile every loaded method's graphs when the engine
        starts (``engine/warmup.py``), not on the first requests.
    """

    target: str | None = None
    draft: str | None = None
    tokenizer: str | None = None
    medusa: str | None = None
    checkpoints: Mapping[str, str] = field(default_factory=dict)
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 8
    max_model_len: int | None = None
    step: str = "auto"
    default_speculation: MethodOptions | None = None
    speculation_length: SpeculationLengthPolicy | None = None
    online_learning: CaptureConfig | None = None
    warm_up: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype != "auto" and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.step not in STEP_CHOICES:
            raise ValueError(f"unknown step {self.step!r}: one of {', '.join(STEP_CHOICES)}")
        if self.speculation_length is not None and not callable(getattr(self.speculation_length, "caps", None)):
            raise TypeError(f"speculation_length must be None (self-tuning) or a policy with caps(), such as "
                            f"SpeculationLengthPolicy(); got {self.speculation_length!r}")

    def step_mode(self, device: torch.device) -> str:
        """The step mode this config runs on ``device`` (``auto`` resolved)."""
        if self.step == "auto":
            return "graphs" if device.type == "cuda" else CPU_AUTO_STEP
        if self.step in ("cudagraph", "graphs") and device.type != "cuda":
            raise ValueError(f"step {self.step!r} captures CUDA graphs and needs a CUDA device; on CPU use "
                             "'compile' (or 'static', or 'eager')")
        return self.step

    def one_shot(self) -> "EngineConfig":
        """This config for one short run (``specray generate``): ``auto`` on a CPU runs eager,
        as compiling takes longer than a few hundred tokens gain."""
        from dataclasses import replace

        if self.step == "auto" and not resolve_device(self.device).startswith("cuda"):
            return replace(self, step="eager")
        return self

    def require_target(self) -> str:
        if self.target is None:
            raise ValueError("EngineConfig.target is required (the built-in demo pair: "
                             "specray.demo.load_or_build_demo_pair().target)")
        return self.target

    def checkpoint(self, key: str) -> str | None:
        """The directory of a method's weights (``MethodSpec.checkpoint``), if configured."""
        return {"draft": self.draft, "medusa": self.medusa, **self.checkpoints}.get(key)

    @property
    def resolved_device(self) -> str:
        return resolve_device(self.device)

    @property
    def resolved_dtype(self) -> str:
        """The dtype name models load in here ("auto" decided for this process's device)."""
        return resolve_dtype(self.dtype, self.device)

    def load_model(self, path: str):
        from specray.engine.runner import load_model

        return load_model(path, self.resolved_dtype, self.resolved_device)

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
