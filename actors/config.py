"""The user-facing configuration of a specray deployment (pydantic; YAML/JSON/CLI edge).

    SpecrayConfig(target="/ckpt/llama-8b", draft="/ckpt/llama-1b",
                  placement={"mode": "separate", "strategy": "SPREAD"})

``engine_config()`` turns it into the engine's frozen dataclass. It lives with the actors
that use it (the Coordinator builds its workers from it); Serve and the CLI build on it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specray.actors.learner import OnlineLearningConfig
from specray.cluster.placement import PlacementConfig
from specray.engine.config import STEP_CHOICES, EngineConfig, resolve_dtype
from specray.engine.memory import DEFAULT_MAX_NUM_SEQS, KVPlan, plan_for_checkpoints
from specray.engine.params import Speculation
from specray.engine.quantization import FP8_KERNELS, check_method
from specray.policies.registry import method_spec, registered_methods
from specray.policies.spec_length import SpeculationLengthPolicy
from specray.policies.suffix_cache import SuffixCacheConfig


class SpecrayConfig(BaseModel):
    """Models, batch limits, default speculation and placement of one coordinator."""

    model_config = ConfigDict(extra="forbid")

    target: str | None = Field(None, description="Target checkpoint dir; None = the demo pair.")
    draft: str | None = Field(None, description="Draft checkpoint dir (method 'draft').")
    tokenizer: str | None = Field(None, description="Tokenizer dir; default: the target's.")
    medusa: str | None = Field(None, description="Medusa heads dir (public layout) for method 'medusa'.")
    checkpoints: dict[str, str] = Field(
        default_factory=dict, description="Weights of other methods by their checkpoint key (e.g. eagle: DIR)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and activations: auto = bfloat16 on CUDA, float32 on CPU.")
    device: str = Field("auto", description="auto (CUDA where the worker has a GPU, else CPU), cpu, cuda or cuda:N.")
    step: Literal[STEP_CHOICES] = Field(
        "auto", description="How a step runs (engine/graphs.py): auto = CUDA graphs over static shapes on CUDA, "
        "eager on CPU; eager (the reference), static, compile (torch.compile), cudagraph, graphs.")
    quantization: str | None = Field(
        None, description="fp8: the target's linear layers quantized at load to float8_e4m3fn with per-channel "
        "scales (weight-only: half of bf16's bytes, dequantized for each matmul; docs/quantization.md); None: "
        "as stored (a checkpoint published in FP8 loads in FP8 either way). vLLM's --quantization.")
    draft_quantization: str | None = Field(
        None, description="The same for the draft model (vLLM: --speculative-config's quantization); heads stay "
        "in the compute dtype.")
    fp8_kernel: Literal[FP8_KERNELS] = Field(
        "dequantize", description="How FP8 layers multiply: dequantize (weight-only W8A16, the reference, any "
        "device) or scaled_mm (W8A8 through torch._scaled_mm: CUDA compute capability >= 8.9 only).")
    max_num_seqs: int | None = Field(
        None, ge=1, description="Sequences batched at once (KV-cache rows); default: sized from GPU memory "
        "(gpu_memory_utilization) on CUDA, 8 on CPU.")
    max_model_len: int | None = Field(
        None, ge=2, description="Context per sequence (prompt + output); default: the model's, at most 4096.")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of the GPU's memory this server may use: weights, activations and "
        "the KV cache, which gets the rest (used only when max_num_seqs is not given).")
    paged_kv: bool = Field(
        True, description="Keep every model's KV in blocks taken from a pool as sequences grow (prefix caching, "
        "preemption; engine/kv_blocks.py); false: each of max_num_seqs rows holds a whole max_model_len context.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block (paged).")
    num_gpu_blocks_override: int | None = Field(
        None, ge=1, description="The target's KV pool in blocks (paged), whatever memory says (vLLM's name).")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="The KV pool in bytes (paged; vLLM's name): on CPU the way to size it; on CUDA "
        "instead of gpu_memory_utilization's share. Default: max_num_seqs contexts on CPU, sized from GPU memory.")
    enable_prefix_caching: bool = Field(
        True, description="Requests that start with a cached prefix reuse its KV blocks and prefill only the rest.")
    grammar_drafter: bool = Field(
        True, description="Structured outputs: the tokens a request's grammar forces (a schema's keys, quotes and "
        "punctuation) are drafted for free and verified like any draft (lossless; docs/structured-outputs.md); "
        "false: constrained requests draft with their method alone.")
    default_speculation: Speculation | None = Field(
        None, description="Speculation for requests that give none; default: the best method loaded (draft, "
        "then EAGLE/ReDrafter/Medusa heads, then prompt lookup) under the self-tuning speculation length.")
    speculation_off_above_batch: int | None = Field(
        None, ge=1, description="Static caps: running batch larger than this, plain decoding for everyone. "
        "Without caps, a controller learns each step's k from measured acceptance and costs."
    )
    speculation_k_caps: list[tuple[int, int]] = Field(
        default_factory=list, description="(min_batch, max_k) pairs capping k as the batch grows."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Ranks the target is split over (Megatron's split, engine/tensor_parallel.py), each an "
        "actor on its own device, their bundles STRICT_PACK on one node; rank 0 runs the step driver.")
    draft_tensor_parallel_size: int | None = Field(
        None, ge=1, description="1 (the default) = the draft model whole, on a device of its own (separate layout) "
        "or in rank 0 (colocated); = tensor_parallel_size = split over the target's ranks.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    overlap_drafting: bool | None = Field(
        None, description="Separate layout: proposer workers draft the next step while the target verifies this one. "
        "None (auto): on where the workers run on GPUs (a draft's device is idle while the target verifies), off on "
        "the CPU (there the ahead forward competes with the verification for the same cores).")
    suffix_cache: SuffixCacheConfig = Field(
        default_factory=SuffixCacheConfig, description="Suffix decoding's trees: depth, the global tree's size, "
        "and whether engine replicas share it (a Ray actor)."
    )
    online_learning: OnlineLearningConfig = Field(
        default_factory=OnlineLearningConfig, description="Drafters that learn from what they serve: capture, a "
        "trainer actor, gated versions swapped into every replica (docs/online-learning.md); off by default."
    )

    @field_validator("quantization", "draft_quantization")
    @classmethod
    def _known_quantization(cls, value, info):
        check_method(value, info.field_name)
        return value

    def engine_config(self, device: str | None = None) -> EngineConfig:
        return EngineConfig(
            target=self.target,
            draft=self.draft,
            tokenizer=self.tokenizer,
            medusa=self.medusa,
            checkpoints=dict(self.checkpoints),
            dtype=self.dtype,
            device=device or self.device,
            step=self.step,
            max_num_seqs=self.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            max_model_len=self.max_model_len,
            default_speculation=self.default_speculation,
            # Caps given: static caps; none: the self-tuning controller.
            speculation_length=SpeculationLengthPolicy(
                self.speculation_off_above_batch, tuple(tuple(p) for p in self.speculation_k_caps)
            ) if self.speculation_off_above_batch is not None or self.speculation_k_caps else None,
            online_learning=self.online_learning.capture() if self.online_learning.enabled else None,
            paged_kv=self.paged_kv,
            block_size=self.block_size,
            num_kv_blocks=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            grammar_drafter=self.grammar_drafter,
            quantization=self.quantization,
            draft_quantization=self.draft_quantization,
            fp8_kernel=self.fp8_kernel,
            tensor_parallel_size=self.tensor_parallel_size,
            draft_tensor_parallel_size=self.draft_tp,
        )

    @property
    def draft_tp(self) -> int:
        """The draft model's tensor-parallel size (1 unless split with the target)."""
        return self.draft_tensor_parallel_size or 1

    @model_validator(mode="after")
    def _tensor_parallel(self):
        if self.draft_tp not in (1, self.tensor_parallel_size):
            raise ValueError(f"draft_tensor_parallel_size must be 1 or tensor_parallel_size "
                             f"({self.tensor_parallel_size}), got {self.draft_tp}")
        if self.draft_tp > 1 and self.online_learning.enabled:
            raise ValueError("online learning swaps drafter weights in rank 0 only: it needs "
                             "draft_tensor_parallel_size 1")
        return self

    def method_facts(self) -> dict[str, dict | None]:
        """Each method these checkpoints enable, with the facts validation needs, read from the
        files without loading any weights (``Limits.methods``; None where a file is unreadable)."""
        config, facts = self.engine_config(), {}
        for name in registered_methods():
            spec = method_spec(name)
            if spec.checkpoint is None:
                facts[name] = {}
                continue
            path = config.checkpoint(spec.checkpoint)
            if path is None and not (self.target is None and spec.checkpoint == "draft"):  # the demo pair has one
                continue
            try:
                facts[name] = spec.offline_facts(path) if spec.offline_facts and path else {}
            except (OSError, ValueError, KeyError, TypeError):
                facts[name] = None
        return facts

    def resolved(self, free_total: tuple[int, int] | None = None) -> "SpecrayConfig":
        """The KV cache's size filled in (``kv_plan``): the Coordinator and the entry points
        call this; the engine never does. Idempotent. Needs a target: the entry points fill
        in the demo pair when none is given (``specray.entrypoints.defaults``)."""
        if self.target is None:
            raise ValueError("no target checkpoint: set target (the entry points default to the demo pair: "
                             "specray.entrypoints.defaults.with_demo_pair(config))")
        cfg = self
        cuda = free_total is not None or cfg.engine_config().resolved_device.startswith("cuda")
        pool_unsized = cfg.paged_kv and cfg.num_gpu_blocks_override is None
        if cfg.max_num_seqs is None or (cuda and pool_unsized) or (pool_unsized and cfg.kv_cache_memory_bytes):
            if cuda or cfg.kv_cache_memory_bytes:
                cfg = cfg.with_plan(cfg.kv_plan(free_total))
            else:  # nothing to size from: the CPU default (the context is the model's, read where it loads)
                cfg = cfg.model_copy(update={"max_num_seqs": DEFAULT_MAX_NUM_SEQS})
        return cfg

    def with_plan(self, plan: KVPlan) -> "SpecrayConfig":
        """This config with a KV plan's numbers (the pool's blocks too, when paged)."""
        update = {"max_num_seqs": plan.max_num_seqs, "max_model_len": plan.max_model_len}
        if plan.num_blocks is not None:  # the pool as planned (its bytes are every model's, target + draft)
            update["num_gpu_blocks_override"] = plan.num_blocks
        return self.model_copy(update=update)

    def kv_plan(self, free_total: tuple[int, int] | None = None) -> KVPlan:
        """The KV cache's rows and context for these checkpoints on this process's device
        (sized from GPU memory where max_num_seqs is not given; ``engine/memory.py``).
        ``free_total``: (free, total) GPU bytes to size from instead of the driver's (tests)."""
        engine = self.engine_config()
        # Each model whose KV the plan sizes: (path, ranks it is split over, its quantization);
        # a parallel draft model (PARD) is a draft model at TP 1.
        models = [(self.target, self.tensor_parallel_size, self.quantization),
                  (self.draft, self.draft_tp, self.draft_quantization),
                  (engine.checkpoint("pard"), 1, self.draft_quantization)]
        models = [m for m in models if m[0] is not None]
        paths, splits, quantization = [m[0] for m in models], [m[1] for m in models], [m[2] for m in models]
        device = "cuda" if free_total is not None else engine.resolved_device
        return plan_for_checkpoints(paths, resolve_dtype(self.dtype, device), max_model_len=self.max_model_len,
                                    max_num_seqs=self.max_num_seqs, utilization=self.gpu_memory_utilization,
                                    device=device, free_total=free_total,
                                    block_size=self.block_size if self.paged_kv else None,
                                    num_blocks=self.num_gpu_blocks_override, kv_bytes=self.kv_cache_memory_bytes,
                                    quantization=quantization, tensor_parallel=splits)
