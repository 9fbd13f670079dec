"""Speculation methods, registered once each: options, validation, needs, placement, proposer.

A method is one file in ``policies/`` that defines its options model, its proposer and a
``MethodSpec`` passed to ``register_method``. Everything else — the engine's step, the Ray
workers, HTTP, batch jobs, the CLI — reads the spec:

* ``options``: a pydantic model with ``method: Literal[name]``; a request's ``speculation``
  is dispatched on ``method`` to its model (``parse_speculation``: a discriminated union that
  methods registered later, e.g. in a test, join).
* ``validate(options, limits)``: the one check of a request's options against what is loaded
  (``Limits``: the context, and facts about each available method's weights, e.g. Medusa's
  head count). The scheduler, the job runner, the CLI and HTTP all call it.
* ``needs_features``: the proposer reads the target's hidden states (they reach it through
  ``CommitRow.features``/``PrefillRow.features``; such proposers live beside the target).
  By default these are the final norm's (the LM head's input); ``feature_layers(resource)``
  names instead the decoder layers whose inputs it reads (EAGLE-3: three of them), handed
  over concatenated in that order.
* ``drafts_trees``: its draft size is its tree, not ``num_speculative_tokens``.
* ``block``: it drafts its whole length in one forward (PARD, DFlash), so a step's drafting
  costs about the same whatever k (the self-tuning controller prices it so).
* ``placement``: ``"worker"`` — may run in an actor of its own (a draft model on its own
  GPU, the n-gram pool); ``"target"`` — runs in the target's process.
* ``checkpoint``: the key of the weights it loads (``EngineConfig.checkpoints``), ``load``
  turning that directory into the resource its proposer is built from, and ``facts``
  describing that resource for validation (also readable offline, without loading it).
  ``inspect(path, target)`` checks such a directory against the target before anything
  starts, from its config and its tensors' headers (no weights read): the method's layout,
  every tensor its loader needs with the shape the target asks for. It raises ValueError (or
  FileNotFoundError) saying what is wrong, and returns facts the caller compares with the
  target and its tokenizer (``vocab_size``: the rows its token ids index). The entry points
  run it for every directory given (``engine/checkpoints.py``).
* ``recipe``: the module whose ``main(argv)`` trains those weights (``specray train NAME``
  finds it here; a name, not an import: training sits above the policies).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

PLAIN = "none"


class MethodOptions(BaseModel):
    """Base of every method's per-request options (frozen; unknown fields are errors)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: str

    @property
    def budget(self) -> int | None:
        """Most draft nodes these options ask for per step (None: the method's own, e.g. a tree)."""
        return getattr(self, "num_speculative_tokens", None)


class UnknownMethodOptions(MethodOptions):
    """Options naming no registered method: they parse, and ``validate`` names the error
    (so that a method registered after a request was built is still found)."""

    model_config = ConfigDict(frozen=True, extra="allow")


class LinearOptions(MethodOptions):
    """Options shared by methods that draft a chain of up to k tokens."""

    num_speculative_tokens: int = Field(4, ge=1, le=64, description="Draft tokens per step (k).")


class TreeAcceptanceOptions(MethodOptions):
    """How tree methods accept at temperature > 0 (greedy rows always use token match)."""

    acceptance: Literal["exact", "typical"] = Field(
        "exact",
        description="exact: recursive rejection sampling over siblings (lossless). typical: Medusa's "
        "typical acceptance (LOSSY, opt-in).",
    )
    posterior_threshold: float = Field(0.09, gt=0, le=1, description="Typical acceptance: hard threshold.")
    posterior_alpha: float = Field(0.3, gt=0, le=1, description="Typical acceptance: entropy factor.")


class PlainOptions(LinearOptions):
    """Plain decoding: the target alone, one token per step. ``num_speculative_tokens`` is
    accepted (and checked) so that one request template serves every method; it is unused."""

    method: Literal["none"] = "none"


@dataclass(frozen=True)
class Limits:
    """What validation knows about the loaded models.

    capacity: tokens per sequence; vocab_size: the target's; eos_ids: its stop tokens;
    methods: facts about each method that can run here (absent = not available), e.g.
    ``{"none": {}, "ngram": {}, "draft": {}, "medusa": {"num_heads": 4}}``; None = available
    but its facts are unknown (read offline from a file that did not parse: the worker
    that loads it reports the problem).
    """

    capacity: int
    vocab_size: int
    eos_ids: frozenset[int] = frozenset()
    methods: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"capacity": self.capacity, "vocab_size": self.vocab_size, "eos_ids": sorted(self.eos_ids),
                "methods": {m: (dict(f) if f is not None else None) for m, f in self.methods.items()}}

    @staticmethod
    def from_dict(d: Mapping) -> "Limits":
        return Limits(int(d["capacity"]), int(d["vocab_size"]), frozenset(d.get("eos_ids", ())),
                      {m: (dict(f) if f is not None else None) for m, f in d.get("methods", {}).items()})


@dataclass(frozen=True)
class MethodSpec:
    """How a method plugs in (see the module doc). ``build(ctx)`` makes its proposer."""

    name: str
    options: type[MethodOptions]
    build: Callable[["ProposerContext"], Any] | None = None
    needs_features: bool = False
    drafts_trees: bool = False
    block: bool = False
    # Its drafts carry per-slot acceptance estimates (``DraftRow.confidence``): the budget lets
    # it draft its whole block and cuts each row after drafting, by those estimates.
    confidence: bool = False
    placement: Literal["worker", "target"] = "target"
    checkpoint: str | None = None
    requirement: str = ""  # what a user must configure, for the "not available" error
    load: Callable[[str, "ProposerContext"], Any] | None = None
    facts: Callable[[Any], dict] | None = None
    offline_facts: Callable[[str], dict] | None = None
    check: Callable[[MethodOptions, Mapping[str, Any], Limits], None] | None = None
    # With needs_features: which target hidden states the proposer reads, given its loaded
    # resource — None: the final norm's, [.., H]; else indices k of the residual stream
    # entering decoder layer k (HF's ``output_hidden_states[k]``), concatenated, [.., len * H].
    feature_layers: Callable[[Any], Sequence[int]] | None = None
    recipe: str | None = None  # dotted module with ``main(argv)`` training this method's weights
    inspect: Callable[[str, "CheckpointTarget"], dict] | None = None

    def validate(self, options: MethodOptions, limits: Limits) -> None:
        """Raise ValueError (naming the field) unless these options can run on these models."""
        if self.name not in limits.methods:
            # Named as a user starts a server (the flag), not as the Python API spells it.
            needs = self.requirement.split(" (")[0] or "resources this server lacks"
            where = f", which this server was not started with (--{self.checkpoint} DIR)" if self.checkpoint else ""
            raise ValueError(f"method {self.name!r} needs {needs}{where}")
        facts = limits.methods[self.name]
        if self.check is not None and facts is not None:
            self.check(options, facts, limits)


@dataclass(frozen=True)
class CheckpointTarget:
    """What a method's checkpoint must fit, read from the target's config and its tokenizer.

    token_ids: how many token ids the engine may hand a proposer (those the tokenizer makes,
    at most the target's vocabulary): an embedding indexed by them needs at least this many
    rows; a padded one (Qwen2.5's 151,936 beside a 152,064 target) is fine.
    """

    hidden_size: int
    vocab_size: int
    num_layers: int
    token_ids: int


@dataclass
class ProposerContext:
    """What a proposer may be built from, in the process it runs in.

    target: the target's ModelRunner (for methods beside the target: its embeddings, LM head);
    resource: what ``spec.load`` made of the method's checkpoint (a draft ModelRunner, heads);
    runner_for: ``runner_for(path_or_model, extra_capacity=0, shift=0, name="draft")`` wraps a causal-LM
        checkpoint dir (or an in-memory model with the HF decoder surface) in a ModelRunner with
        the engine's slots and context (+ extra positions) on this device, its KV paged like the
        target's (given by the engine core, which owns the runner); ``shift``: tokens past a
        cache entry that the entry depends on (1 for EAGLE-style heads: entry i reads the
        target's feature at i and token i + 1), for prefix caching.
    step: the engine's step mode (``engine/graphs.py``): proposers that run models of their
        own give them the same fixed-shape (and compiled) forwards as the target's.
    """

    vocab_size: int
    max_num_seqs: int
    capacity: int
    device: str = "cpu"
    dtype: str = "float32"
    target: Any = None
    resource: Any = None
    runner_for: Callable[..., Any] | None = None
    step: str = "eager"

    def place(self, module):
        """``module`` (a head, a drafter) on the target's device and in the target's dtype:
        its outputs meet the target's features and LM head (bf16/fp16 targets included)."""
        import torch

        if self.target is not None:
            return module.to(device=self.target.device, dtype=self.target.dtype)
        return module.to(device=self.device, dtype=getattr(torch, self.dtype))


_METHODS: dict[str, MethodSpec] = {}
# Other spellings of a method (vLLM's ``draft_model`` is ``draft``), and options that select
# another method: vLLM's ``{"method": "draft_model", "parallel_drafting": true}`` is PARD.
_ALIASES: dict[str, str] = {}
_VARIANTS: dict[tuple[str, str], str] = {}  # (method, option set true) -> the method it selects


def register_alias(alias: str, method: str) -> None:
    """Accept ``alias`` wherever a request names ``method``."""
    _ALIASES[alias] = method


def register_variant(method: str, option: str, variant: str) -> None:
    """``{"method": method, option: true}`` selects ``variant`` (``option: false``: ``method`` itself)."""
    _VARIANTS[(method, option)] = variant


def resolve_method(value: Mapping) -> tuple[Any, dict]:
    """(the method a speculation dict selects, the dict with ``method`` set to it): aliases
    resolved, a variant's selecting option applied (kept for the variant, which accepts it;
    dropped when false)."""
    value = dict(value)
    name = value.get("method", PLAIN)
    if not isinstance(name, str):
        return name, value
    name = _ALIASES.get(name, name)
    for (base, option), variant in _VARIANTS.items():
        if base == name and option in value:
            flag = value[option]
            if flag is True:
                name = variant
            elif flag is False or flag is None:
                value.pop(option)
            else:
                raise ValueError(f"speculation.{option} must be true or false, got {flag!r}")
            break
    value["method"] = name
    return name, value


def register_method(spec: MethodSpec) -> MethodSpec:
    """Make ``spec.name`` selectable as ``speculation.method`` everywhere."""
    _METHODS[spec.name] = spec
    return spec


def unregister_method(name: str) -> None:
    """Undo ``register_method`` (a plugin unloaded, a test's method cleaned up)."""
    _METHODS.pop(name, None)


def method_spec(name: str) -> MethodSpec:
    if name not in _METHODS:
        raise ValueError(f"unknown speculation method {name!r}; known: {registered_methods()}")
    return _METHODS[name]


def registered_methods() -> list[str]:
    return sorted(_METHODS)


def parse_speculation(value: Any) -> MethodOptions:
    """A request's ``speculation`` (a dict, or options already built) as its method's options."""
    if isinstance(value, MethodOptions):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"speculation must be an object with a 'method', got {type(value).__name__}")
    name, value = resolve_method(value)
    spec = _METHODS.get(name) if isinstance(name, str) else None
    model = spec.options if spec is not None else UnknownMethodOptions
    return model.model_validate(value)


def validate_speculation(options: MethodOptions, limits: Limits) -> None:
    """The one validation of a request's speculation (ValueError with a clear message)."""
    method_spec(options.method).validate(options, limits)


register_method(MethodSpec(PLAIN, PlainOptions))
