"""The weights a configuration names, checked before anything starts.

The entry points (``specray serve`` and ``serve --once``, ``generate``, ``jobs``) call
``checkpoint_problems`` once their configuration is whole (the demo pair filled in), before
Ray or any model starts. (An application started from a Serve YAML has no such moment of its
own: there, a replica whose workers fail to start answers every request with that cause —
``CoordinatorCore.start``.) From config files and tensor headers only — no
weights are read — it checks:

* the target: a causal LM of a family specray serves, with every weight present;
* each method's directory (``--draft``, ``--medusa``, ``--eagle``, ``--eagle3``,
  ``--redrafter``, a ``--speculative-config`` model, and any method registered later) by its
  ``MethodSpec.inspect``: the method's layout, every tensor its loader needs in the shape the
  target asks for (hidden size, layers), a draft model whole;
* vocabularies: a method whose token ids index its own table (a draft model's embedding, a
  drafter's head) needs a row for every id the tokenizer makes (padded tables are fine);
* a default speculation (``--speculative-config``) whose method has weights configured;
* quantization (``engine/quantization.py``): a target or draft whose ``quantization_config``
  specray cannot read (GPTQ, AWQ, int8 compressed-tensors, ...), a published FP8 checkpoint
  whose FP8 tensors lack their scales, ``draft_quantization`` without a draft model, or
  ``fp8_kernel scaled_mm`` where this device has no FP8 matmul.

A problem is a ``CheckpointProblem`` (the config key, the path, what is wrong); the entry
points name the flag and stop with one line. A directory that fails its method's check but
passes another method's says so (an EAGLE head passed as ``--draft``: "use --eagle").
"""

from __future__ import annotations

from dataclasses import dataclass

from specray.engine.architectures import check_architecture
from specray.engine.config import EngineConfig, load_tokenizer
from specray.engine.quantization import checkpoint_quantization, stored_fp8_problems
from specray.kernels.fp8 import scaled_mm_problem
from specray.policies.checkpoint_files import causal_lm_facts
from specray.policies.registry import CheckpointTarget, method_spec, registered_methods


@dataclass(frozen=True)
class CheckpointProblem:
    key: str  # "target", or a MethodSpec.checkpoint key ("draft", "eagle", ...), or "default_speculation"
    path: str | None
    message: str


def checkpoint_problems(config: EngineConfig) -> list[CheckpointProblem]:
    """Every problem with the checkpoints ``config`` names (empty: all of them fit)."""
    import specray.policies  # noqa: F401 - every method registered

    target_dir = config.require_target()
    problem = _quantization_problem(target_dir)
    if problem is not None:
        return [CheckpointProblem("target", target_dir, problem)]
    try:
        facts = causal_lm_facts(target_dir)
        from transformers import AutoConfig

        check_architecture(AutoConfig.from_pretrained(target_dir))
    except (OSError, ValueError) as exc:
        return [CheckpointProblem("target", target_dir, _line(exc))]
    tokenizer = load_tokenizer(config.tokenizer or target_dir)
    ids = min(len(tokenizer), facts["vocab_size"]) if tokenizer is not None else facts["vocab_size"]
    target = CheckpointTarget(facts["hidden_size"], facts["vocab_size"], facts["num_layers"], ids)
    problems = _quantization_settings(config)
    for key, path in _checkpoints(config).items():
        problem = _quantization_problem(path) if key == "draft" else None
        problem = problem or _method_problem(key, path, target)
        if problem is not None:  # the path is in the line already: drop it from the message
            problems.append(CheckpointProblem(key, path, problem.replace(path.rstrip("/") + "/", "")))
    default = config.default_speculation
    if default is not None:
        needs = method_spec(default.method).checkpoint
        if needs is not None and config.checkpoint(needs) is None:
            what = _what(needs)
            problems.append(CheckpointProblem("default_speculation", None,
                                              f"method {default.method!r} needs {what}: give its directory as "
                                              f"\"model\" or --{needs} DIR"))
    return problems


def problems_line(problems: list[CheckpointProblem], flags: bool = True,
                  speculative_model: str | None = None) -> str:
    """The problems as one line, each naming where its directory was given: a flag
    (``--draft DIR: ...``) or, with ``flags=False``, a config key (``draft: DIR: ...``); a
    directory given as ``--speculative-config``'s ``model`` is named so."""
    parts = []
    for p in problems:
        if p.key == "default_speculation":
            where = "--speculative-config" if flags else "default_speculation"
        elif p.path is None:  # a setting, not a directory
            where = f"--{p.key.replace('_', '-')}" if flags else p.key
        elif speculative_model is not None and p.path == speculative_model:
            where = f"--speculative-config model {p.path}"
        else:
            where = f"--{p.key} {p.path}" if flags else f"{p.key}: {p.path}"
        parts.append(f"{where}: {p.message}")
    return "; ".join(parts)


def _quantization_problem(path: str) -> str | None:
    """Why a causal-LM checkpoint's quantization cannot load (None: unquantized, or FP8 specray reads)."""
    try:
        stored = checkpoint_quantization(path)
        if stored is None:
            return None
        problems = stored_fp8_problems(path, stored)
    except (OSError, ValueError) as exc:
        return _line(exc)
    return "; ".join(problems) or None


def _quantization_settings(config: EngineConfig) -> list[CheckpointProblem]:
    problems = []
    if config.draft_quantization is not None and config.draft is None:
        problems.append(CheckpointProblem("draft_quantization", None, "quantizes the draft model, but none is loaded "
                                          "(give --draft DIR, or drop it)"))
    learning = config.online_learning
    if config.draft_quantization is not None and learning is not None and (
            learning.methods is None or "draft" in learning.methods):
        problems.append(CheckpointProblem("draft_quantization", None, "online learning fine-tunes the draft model in "
                                          "float and swaps it in; a quantized draft cannot take it: drop one of them"))
    if config.fp8_kernel == "scaled_mm" and (problem := scaled_mm_problem(config.resolved_device)):
        problems.append(CheckpointProblem("fp8_kernel", None, f"scaled_mm: {problem}; use dequantize"))
    return problems


def _checkpoints(config: EngineConfig) -> dict[str, str]:
    """Checkpoint key -> directory, for every method key the config sets."""
    keys = {method_spec(m).checkpoint for m in registered_methods()} - {None}
    return {k: config.checkpoint(k) for k in sorted(keys) if config.checkpoint(k) is not None}


def _method_problem(key: str, path: str, target: CheckpointTarget) -> str | None:
    problem = _inspect(key, path, target)
    if problem is None:
        return None
    # Any causal LM passes as a draft model: a directory that also passes a more specific
    # method's check (a PARD model) is named for that method.
    fits = sorted((k for k in _inspectable() if k != key and _inspect(k, path, target) is None),
                  key=lambda k: k == "draft")
    return problem + (f"; it holds {_what(fits[0])}: pass it with --{fits[0]}" if fits else "")


def _inspect(key: str, path: str, target: CheckpointTarget) -> str | None:
    spec = method_spec(next(m for m in registered_methods() if method_spec(m).checkpoint == key))
    if spec.inspect is None:
        return None
    try:
        facts = spec.inspect(path, target) or {}
    except Exception as exc:  # noqa: BLE001 - any failure is this layout's problem (a config transformers'
        return _line(exc)     # validators refuse raises their own error types), said in one line
    rows = facts.get("vocab_size")
    if rows is not None and rows < target.token_ids:
        return (f"its vocabulary has {rows} tokens, but the target's tokenizer makes ids up to "
                f"{target.token_ids - 1}: it does not fit this target")
    return None


def _inspectable() -> list[str]:
    return sorted({method_spec(m).checkpoint for m in registered_methods()
                   if method_spec(m).checkpoint and method_spec(m).inspect is not None})


def _what(key: str) -> str:
    name = next(m for m in registered_methods() if method_spec(m).checkpoint == key)
    return method_spec(name).requirement.split(" (")[0]


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
