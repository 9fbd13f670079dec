"""Configuration of the Serve application (pydantic; from Python, YAML or the CLI).

Two spellings of one config: the nested layout (``model_name``, ``engine: {...}``, ...) and
vLLM's flat option names, as ``vllm serve`` takes them on the command line and in its
``--config`` YAML (``served-model-name``, ``max-model-len``, ``speculative-config``, ...;
dashes or underscores). ``specray serve`` flags are exactly these names, and override the
file's values. Ray Serve silently ignores unknown ``autoscaling_config`` keys, so a typo
would quietly disable autoscaling; here the keys are checked against a strict model first.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specray.actors.config import SpecrayConfig
from specray.engine.admission import AdmissionPolicy
from specray.policies.registry import PLAIN, method_spec, parse_speculation, resolve_method
from specray.protocol.tool_parsers import PARSER_NAMES

DEMO_MODEL_NAME = "specray-demo"

# vLLM's flat option names -> where they live here (flags and flat YAML keys read this).
FLAT_KEYS: dict[str, tuple[str, ...]] = {
    "served_model_name": ("model_name",),
    "model": ("engine", "target"),
    "target": ("engine", "target"),
    "draft": ("engine", "draft"),
    "tokenizer": ("engine", "tokenizer"),
    "medusa": ("engine", "medusa"),
    "dtype": ("engine", "dtype"),
    "device": ("engine", "device"),
    "step": ("engine", "step"),
    "max_model_len": ("engine", "max_model_len"),
    "max_num_seqs": ("engine", "max_num_seqs"),
    "gpu_memory_utilization": ("engine", "gpu_memory_utilization"),
    "paged_kv": ("engine", "paged_kv"),
    "block_size": ("engine", "block_size"),
    "num_gpu_blocks_override": ("engine", "num_gpu_blocks_override"),
    "kv_cache_memory_bytes": ("engine", "kv_cache_memory_bytes"),
    "enable_prefix_caching": ("engine", "enable_prefix_caching"),
    "grammar_drafter": ("engine", "grammar_drafter"),
    "quantization": ("engine", "quantization"),
    "draft_quantization": ("engine", "draft_quantization"),
    "fp8_kernel": ("engine", "fp8_kernel"),
    "tensor_parallel_size": ("engine", "tensor_parallel_size"),
    "draft_tensor_parallel_size": ("engine", "draft_tensor_parallel_size"),
}
# vLLM's names for methods and their options in --speculative-config, as specray's.
SPEC_METHOD_ALIASES = {"prompt_lookup": "ngram"}  # (draft_model and parallel_drafting: the registry's)
SPEC_KEY_ALIASES = {"prompt_lookup_max": "max_matching_ngram_size"}
SPEC_ENGINE_KEYS = ("draft_tensor_parallel_size",)


def speculative_config(value: Any) -> tuple[dict, str | None, str | None, dict]:
    """vLLM's ``--speculative-config`` (a JSON object or its text): ``method``,
    ``num_speculative_tokens``, ``model`` (the method's weights dir), ``quantization`` (the draft
    model's, as vLLM's), ``draft_tensor_parallel_size`` and the method's own options -> (the
    server's default speculation, checkpoint key, weights dir, engine settings: the draft's
    quantization and tensor-parallel size). Only the keys given are set, so a length left out
    stays with the self-tuning controller."""
    flag = "--speculative-config"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: not JSON ({exc.msg} at character {exc.pos}); e.g. "
                             """'{"method": "draft", "model": "DIR", "num_speculative_tokens": 4}'""") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: must be a JSON object with a 'method', got {type(value).__name__}")
    fields = {SPEC_KEY_ALIASES.get(k, k): v for k, v in value.items()}
    model = fields.pop("model", None)
    quantization = fields.pop("quantization", None)
    # A deployment setting, not a request's: where the draft model runs (1, or the target's size).
    engine = {k: fields.pop(k) for k in SPEC_ENGINE_KEYS if k in fields}
    method = fields.pop("method", None) or ("draft" if model else None)
    if method is None:
        raise ValueError(f"{flag}: give a 'method' (e.g. draft, ngram, medusa, eagle)")
    try:
        method, fields = resolve_method({**fields, "method": SPEC_METHOD_ALIASES.get(method, method)})
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    fields.pop("method")
    spec = method_spec(method)  # unknown: "unknown speculation method ...; known: [...]"
    if model is not None and spec.checkpoint is None:
        raise ValueError(f"{flag}: method {method!r} loads no weights; drop 'model'")
    try:
        options = parse_speculation({"method": method, **fields})
    except ValueError as exc:  # pydantic: one line per bad key
        errors = getattr(exc, "errors", lambda: [])()
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors] or [str(exc)]
        raise ValueError(f"{flag}: " + "; ".join(lines)) from None
    if quantization is not None and method != "draft":
        raise ValueError(f"{flag}: 'quantization' is the draft model's (method draft); method {method!r} has none")
    if quantization is not None:
        engine["draft_quantization"] = quantization
    return options.model_dump(exclude_unset=True) | {"method": method}, spec.checkpoint, model, engine


def flat_to_nested(data: dict) -> dict:
    """Move vLLM-style flat keys (``max-model-len``, ``speculative-config``, ...) of a config
    dict to their nested places; other keys are kept as they are (and checked strictly)."""
    out: dict = {}
    engine = dict(data.get("engine") or {})
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == "engine":
            continue
        if name in FLAT_KEYS and value is not None:
            path = FLAT_KEYS[name]
            if path[0] == "engine":
                engine[path[1]] = value
            else:
                out[path[0]] = value
        elif name not in _top_level() and _is_checkpoint_key(name):  # --eagle DIR, --redrafter DIR, ...
            if value is not None:
                engine.setdefault("checkpoints", {})[name] = value
        elif name == "online_learning" and value is not None:  # --online-learning, or the section
            section = {"enabled": True} if value is True else {"enabled": False} if value is False else dict(value)
            engine["online_learning"] = {**(engine.get("online_learning") or {}), **section}
        elif name == "speculative_config":
            if value is None:
                continue
            options, key_, model, settings = speculative_config(value)
            engine["default_speculation"] = options
            engine.update(settings)
            if model is not None:
                if key_ in ("draft", "medusa"):
                    engine[key_] = model
                else:
                    engine.setdefault("checkpoints", {})[key_] = model
        else:
            out[name if name in _top_level() else key] = value
    if engine or "engine" in data:
        out["engine"] = engine
    return out


def _top_level() -> frozenset[str]:
    return frozenset(ServeConfig.model_fields)


def _is_checkpoint_key(name: str) -> bool:
    from specray.policies.registry import registered_methods

    return any(method_spec(m).checkpoint == name for m in registered_methods())


RAY_METRICS_INTERVAL_S = 10.0  # Ray Serve's default metrics_interval_s (ray.serve.config.AutoscalingConfig)


class AutoscalingSpec(BaseModel):
    """Ray Serve's ``autoscaling_config`` keys that specray passes through, strictly."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    initial_replicas: int | None = Field(None, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(3.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    metrics_interval_s: float | None = Field(None, gt=0, description="Deprecated by Ray; passed only if set.")
    look_back_period_s: float = Field(
        15.0, gt=0, description="Seconds of load the autoscaler averages over; more than metrics_interval_s (Ray's "
        f"default {RAY_METRICS_INTERVAL_S:g}), which Ray requires (a FutureWarning now, an error in a later Ray).")
    upscaling_factor: float | None = Field(None, gt=0)
    downscaling_factor: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _order(self):
        # Ray only warns (FutureWarning) and will raise in a later release: say it here, once.
        interval = self.metrics_interval_s or RAY_METRICS_INTERVAL_S
        if self.look_back_period_s <= interval:
            which = "" if self.metrics_interval_s else ", Ray's default"
            raise ValueError(f"look_back_period_s ({self.look_back_period_s:g}) must be greater than "
                             f"metrics_interval_s ({interval:g}{which})")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self


class ServeConfig(BaseModel):
    """One OpenAI-compatible application: a model served by autoscaling engine replicas.

    >>> ServeConfig(model_name="demo", autoscaling={"min_replicas": 1, "max_replicas": 2})  # doctest: +SKIP
    """

    model_config = ConfigDict(extra="forbid")

    model_name: str | None = Field(
        None, min_length=1, description="The id clients pass as `model` (vLLM: served_model_name); default: the "
        "target directory's name, or specray-demo for the demo pair.")
    engine: SpecrayConfig = Field(default_factory=SpecrayConfig, description="Models, batch and placement.")
    num_replicas: int = Field(1, ge=1, description="Engine replicas when autoscaling is off.")
    autoscaling: AutoscalingSpec | None = Field(None, description="Ray Serve autoscaling (strict keys).")
    max_ongoing_requests: int = Field(32, ge=1, description="Requests in flight per engine replica.")
    max_queued_requests: int = Field(
        64, ge=0, description="Requests Serve queues for a busy replica; beyond them, 503 (bounded, never unbounded).")
    max_sequences_per_request: int = Field(
        4096, ge=1, description="Most sequences (prompts x n) one request may ask for; more is a 400 before anything "
        "runs (OpenAI takes up to 2,048 prompts in a request).")
    max_waiting_sequences: int = Field(
        2048, ge=0, description="While more sequences than this wait in a replica beyond its running batch, a new "
        "request gets 503 with Retry-After; a request that finds none waiting is always taken whole.")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a request gives none (OpenAI: 16).")
    api_key: str | None = Field(
        None, description="Bearer token clients must send; default from $SPECRAY_API_KEY; None = open."
    )
    graceful_shutdown_s: float = Field(
        2.0, ge=0, description="On SIGINT/SIGTERM (specray serve drains: new requests get 503) and on shutdown, how "
        "long requests in flight may take to finish before they end with an error (Serve's default: 20 s).")
    host: str = Field("127.0.0.1")
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = Field("/")
    runtime_env: dict | None = Field(
        None, description="Ray runtime environment of the replicas and of the workers they start (as ray.serve.llm's "
        "LLMConfig.runtime_env): env_vars, pip, or a worker_process_setup_hook that registers methods of your own.")
    enable_auto_tool_choice: bool = Field(
        False, description="tool_choice 'auto' (the default with tools): the model's calls are parsed by "
        "tool_call_parser (vLLM's flag; without it such a request is a 400).")
    tool_call_parser: str | None = Field(
        None, description=f"how auto tool choice reads calls: {', '.join(PARSER_NAMES)} (vLLM's names; "
        "docs/tool-calling.md).")

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data):
        return flat_to_nested(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _default_name(self):
        if self.model_name is None:
            target = self.engine.target
            self.model_name = os.path.basename(os.path.normpath(target)) if target else DEMO_MODEL_NAME
        return self

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, v):
        if v is not None and v not in PARSER_NAMES:
            raise ValueError(f"unknown tool-call parser {v!r}; choose one of {', '.join(PARSER_NAMES)}")
        return v

    @model_validator(mode="after")
    def _auto_needs_a_parser(self):
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(PARSER_NAMES)})")
        return self

    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice 'auto', None where auto tool choice is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def admission_policy(self) -> AdmissionPolicy:
        """The one policy that admits a request whole or refuses it whole (engine/admission.py)."""
        return AdmissionPolicy(self.max_sequences_per_request, self.max_waiting_sequences)

    def resolved_api_key(self) -> str | None:
        return self.api_key if self.api_key is not None else os.environ.get("SPECRAY_API_KEY") or None
