"""Engine configuration: plain frozen dataclasses (pydantic lives at the user edge)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch

from specray.engine.capture import CaptureConfig
from specray.engine.kv_blocks import DEFAULT_BLOCK_SIZE, PagingConfig, blocks_needed
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
PROFILE_COSTS_VAR = "SPECRAY_PROFILE_COSTS"
"""``0``: engines start without the cost profile unless their config asks for it."""


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
        prompt lookup), its length left to the verification budget.
    speculation_length: static caps of k by running batch size (off above a batch size),
        whatever requests ask for; None (default) = the verification budget
        (``policies/budget.py``): each step verifies the draft slots, per request and
        position, worth their cost by the profiled cost table (0 when none is).
    tensor_parallel_size: ranks the target is split over (``engine/tensor_parallel.py``), each a
        process on its own device; > 1 runs only under the Ray actors (rank 0 is the engine
        worker, ``engine/mirror.py``), the in-process engine refuses it.
    draft_tensor_parallel_size: 1 (default) = the draft model whole, on rank 0's device or a
        worker of its own; = tensor_parallel_size = split over the same ranks as the target.
    online_learning: capture for online learning (``engine/capture.py``) and versioned
        drafters that can be swapped between steps (``engine/drafter_versions.py``); None
        (default): neither.
    warm_up: under a compiled step, compile every loaded method's graphs when the engine
        starts (``engine/warmup.py``), not on the first requests.
    profile_costs: measure the verification budget's cost table when the engine starts: a
        few steps at each batch-size bucket and width, and each loaded drafter's forwards
        (``engine/profile.py``); False: the table fills from served steps alone, as it does
        under the compiled steps (``compile``, ``graphs``: each new shape compiles a graph).
        Unset, it is on unless the environment says ``SPECRAY_PROFILE_COSTS=0`` (for every
        engine of a process and of the Ray workers it starts: quick restarts, test suites).
    paged_kv: keep every model's KV in blocks of ``block_size`` tokens taken from one pool
        per model as sequences grow (default; ``engine/kv_blocks.py``), or False: each of the
        ``max_num_seqs`` rows holds a whole ``max_model_len`` context (the contiguous layout).
    num_kv_blocks / kv_cache_memory_bytes: the target's pool, in blocks or in bytes (vLLM's
        name); neither = the memory of ``max_num_seqs`` whole contexts. With paging,
        ``max_num_seqs`` is a cap on the running batch, not the memory plan.
    enable_prefix_caching: requests that start with a cached prefix (full blocks) reuse its
        KV and prefill only the rest (paged only; default on).
    quantization: ``fp8`` quantizes the target's linear layers at load (float8_e4m3fn weights,
        per-channel scales; ``engine/quantization.py``); None (default): as stored — a checkpoint
        published in FP8 loads in FP8 either way.
    draft_quantization: the same for the draft model (vLLM: ``--speculative-config``'s
        ``quantization``); heads (Medusa, EAGLE, ReDrafter) stay in the compute dtype.
    grammar_drafter: structured outputs: the tokens a row's grammar forces (a schema's keys and
        punctuation) are drafted for free and verified like any draft (``engine/grammar.py``;
        lossless); False: constrained rows draft with their method alone.
    fp8_kernel: how FP8 layers multiply: ``dequantize`` (default; weight-only W8A16, any device)
        or ``scaled_mm`` (W8A8 with ``torch._scaled_mm``; CUDA compute capability >= 8.9 only).
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
    profile_costs: bool = field(default_factory=lambda: os.environ.get(PROFILE_COSTS_VAR, "1") != "0")
    paged_kv: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    quantization: str | None = None
    draft_quantization: str | None = None
    fp8_kernel: str = "dequantize"
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int = 1
    grammar_drafter: bool = True

    def __post_init__(self):
        from specray.engine.quantization import check_kernel, check_method

        check_method(self.quantization)
        check_method(self.draft_quantization, "draft_quantization")
        check_kernel(self.fp8_kernel)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.draft_tensor_parallel_size not in (1, self.tensor_parallel_size):
            raise ValueError(f"draft_tensor_parallel_size must be 1 or tensor_parallel_size "
                             f"({self.tensor_parallel_size}), got {self.draft_tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype != "auto" and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.step not in STEP_CHOICES:
            raise ValueError(f"unknown step {self.step!r}: one of {', '.join(STEP_CHOICES)}")
        if self.block_size < 1 or (self.num_kv_blocks is not None and self.num_kv_blocks < 1):
            raise ValueError(f"block_size and num_kv_blocks must be >= 1, got {self.block_size}, {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
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
    def paging(self, capacity: int, bytes_per_token: int) -> PagingConfig | None:
        """The target's paged layout (None: contiguous): its pool from ``num_kv_blocks``, else
        ``kv_cache_memory_bytes`` (``bytes_per_token``: the model's K and V of one token over
        all layers), else ``max_num_seqs`` whole contexts of ``capacity`` tokens."""
        if not self.paged_kv:
            return None
        blocks = self.num_kv_blocks
        if blocks is None and self.kv_cache_memory_bytes is not None:
            blocks = self.kv_cache_memory_bytes // (bytes_per_token * self.block_size)
            if blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes {self.kv_cache_memory_bytes} holds no block of "
                                 f"{self.block_size} tokens ({bytes_per_token * self.block_size} bytes)")
        if blocks is None:
            blocks = self.max_num_seqs * blocks_needed(capacity, self.block_size)
        return PagingConfig(self.block_size, blocks, self.enable_prefix_caching)

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

    def load_model(self, path: str, role: str = "target"):
        """The checkpoint at ``path`` on this config's device and dtype, quantized as the config
        says for its ``role`` (``target`` or ``draft``)."""
        from specray.engine.runner import load_model

        quantization = self.quantization if role == "target" else self.draft_quantization
        return load_model(path, self.resolved_dtype, self.resolved_device, quantization, self.fp8_kernel)

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
