"""The command line's flags, read off the configs they fill (nothing is listed twice).

* Model and server flags are vLLM's ``vllm serve`` names (``serve/config.py: FLAT_KEYS``):
  ``specray serve`` and ``specray generate`` share the model group, the YAML file takes the
  same names, and a flag overrides the file.
* Speculation option flags are generated from every registered method's options model:
  one flag per field name, its help naming every method that has it, with each one's
  default; booleans are ``--x/--no-x``. A flag of a method the request does not use is an
  error (``check_method_flags``), never silently ignored.
* Errors become one line naming the flag the user typed (``one_line``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import typing
from dataclasses import dataclass

from pydantic import ValidationError

from specray.engine.config import DEVICES, DTYPES, STEP_CHOICES
from specray.engine.quantization import FP8_KERNELS, QUANTIZATION_METHODS
from specray.policies.registry import PLAIN, method_spec, registered_methods
from specray.serve.config import FLAT_KEYS

# How a config location reads as a flag in messages (the reverse of FLAT_KEYS, plus the
# keys that are not plain paths).
_PATH_FLAGS = {path: "--" + key.replace("_", "-") for key, path in FLAT_KEYS.items() if key not in ("model",)}
_PATH_FLAGS[("engine", "default_speculation")] = "--speculative-config"
_PATH_FLAGS[("engine", "checkpoints")] = "--<method> DIR"
_PATH_FLAGS.update({("tool_call_parser",): "--tool-call-parser", ("enable_auto_tool_choice",): "--enable-auto-tool-choice"})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def one_line(exc: Exception, fields: dict[str, str] | None = None) -> str:
    """A ValidationError (or any error) as one line; config locations named as flags
    (``fields``: option field -> its flag, for a request's speculation options)."""
    if not isinstance(exc, ValidationError):
        return " ".join(str(exc).split())
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        name = (_PATH_FLAGS.get(loc[:2]) or _PATH_FLAGS.get(loc[:1]) or (fields or {}).get(loc[0] if loc else "")
                or (".".join(loc) if loc else ""))
        if loc and loc[0] == "engine" and len(loc) > 1 and loc[:2] not in _PATH_FLAGS:
            name = f"engine.{'.'.join(loc[1:])}"
        given = err.get("input")
        shown = f" {given}" if name.startswith("--") and isinstance(given, (str, int, float)) else ""
        parts.append(f"{name}{shown}: {msg}" if name else msg)
    return "; ".join(" ".join(p.split()) for p in parts)


# -- model and server flags (serve, generate) ------------------------------------------------
def checkpoint_keys() -> list[str]:
    import specray.policies  # noqa: F401  (registers the methods)

    keys = {method_spec(m).checkpoint for m in registered_methods()}
    return sorted(k for k in keys if k)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Which weights, on what, in what precision, with how much cache (vLLM's names)."""
    g = p.add_argument_group("model", "which weights, where, and how much KV cache (default: the built-in demo pair)")
    g.add_argument("--target", "--model", dest="target", metavar="DIR", default=None,
                   help="target checkpoint (a Hugging Face directory); alone it serves with prompt lookup "
                        "(default: the demo pair's target and its draft)")
    g.add_argument("--tokenizer", metavar="DIR", default=None, help="tokenizer directory (default: the target's)")
    for key in checkpoint_keys():
        methods = [m for m in registered_methods() if method_spec(m).checkpoint == key]
        g.add_argument(f"--{key}", metavar="DIR", default=None,
                       help=f"{method_spec(methods[0]).requirement.split(' (')[0]}: enables method {', '.join(methods)}")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="weights and activations (default: auto = bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--quantization", "-q", metavar="METHOD", default=None,
                   help=f"quantize the target's weights at load: {', '.join(QUANTIZATION_METHODS)} (float8_e4m3fn "
                        "linear layers, per-channel scales, dequantized for each matmul: half of bf16's bytes); "
                        "a checkpoint published in FP8 loads in FP8 without it (default: as stored)")
    g.add_argument("--draft-quantization", metavar="METHOD", default=None,
                   help="the same for the draft model (also --speculative-config's \"quantization\", as vLLM's; "
                        "default: as stored)")
    g.add_argument("--fp8-kernel", choices=FP8_KERNELS, default=None,
                   help="how FP8 layers multiply: dequantize (weight-only, any device) or scaled_mm (FP8 "
                        "activations too, torch._scaled_mm; CUDA compute capability >= 8.9) (default: dequantize)")
    g.add_argument("--device", metavar="{" + ",".join(DEVICES) + ",cuda:N}", default=None,
                   help="where models run (default: auto = CUDA when available)")
    g.add_argument("--step", choices=STEP_CHOICES, default=None,
                   help="how a step runs: auto = CUDA graphs over static shapes on CUDA, eager on CPU; eager is "
                        "the reference; compile = torch.compile of the static step (faster on CPU too)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="vLLM's name for --step eager: no graphs, no compile")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N", default=None,
                   help="split the target over N ranks, each a Ray actor on its own GPU, STRICT_PACK on one node "
                        "(default: 1); the draft model stays whole unless --speculative-config sets "
                        "draft_tensor_parallel_size N (docs/tensor-parallel.md)")
    g.add_argument("--max-model-len", type=int, metavar="N", default=None,
                   help="context per sequence, prompt + output (default: the model's, at most 4096)")
    g.add_argument("--max-num-seqs", type=int, metavar="N", default=None,
                   help="most sequences decoded together (paged KV: a cap, the pool sets the memory; contiguous: the KV "
                        "cache's rows) (default: 256 on CUDA when paged, else sized from GPU memory; 8 on CPU)")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION", default=None,
                   help="share of the GPU's memory for weights + activations + KV cache, which sizes "
                        "--max-num-seqs when it is not given (default: 0.9)")
    g.add_argument("--block-size", type=int, metavar="N", default=None, help="tokens per KV block (default: 16)")
    g.add_argument("--kv-cache-memory-bytes", type=int, metavar="BYTES", default=None,
                   help="the KV pool's size in bytes (on CPU, the way to size it; default: --max-num-seqs contexts "
                        "on CPU, sized from GPU memory on CUDA)")
    g.add_argument("--num-gpu-blocks-override", type=int, metavar="N", default=None,
                   help="the KV pool's size in blocks, whatever memory says")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="requests starting with a cached prefix reuse its KV blocks (default: on)")
    g.add_argument("--grammar-drafter", action=argparse.BooleanOptionalAction, default=None,
                   help="structured outputs: draft the tokens a request's grammar forces (a schema's keys, quotes "
                        "and punctuation) for free, verified like any draft (lossless; default: on)")
    g.add_argument("--paged-kv", action=argparse.BooleanOptionalAction, default=None,
                   help="KV in blocks from a pool, with prefix caching and preemption (default: on); "
                        "--no-paged-kv: each sequence holds a whole --max-model-len context")
    g.add_argument("--speculative-config", metavar="JSON", default=None,
                   help="the server's default speculation, vLLM's keys: method, num_speculative_tokens, model "
                        "(the method's weights) and the method's options, e.g. "
                        """'{"method": "draft", "model": "DIR", "num_speculative_tokens": 4}'; """
                        "and draft_tensor_parallel_size: 1 (the draft whole) or the target's size (default: the best "
                        "method loaded: draft, then heads, then ngram; length self-tuned)")
    g.add_argument("--online-learning", action="store_true", default=None,
                   help="drafters learn from what they serve: captured traffic, a trainer actor, gated versions "
                        "swapped into every replica (online_learning: in a config file for its settings; "
                        "docs/online-learning.md)")


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="YAML or JSON: these flags' names as keys (or ServeConfig's nested layout); flags override it")
    g.add_argument("--served-model-name", "--model-name", dest="served_model_name", metavar="NAME", default=None,
                   help="the model id clients send (default: the target directory's name, or specray-demo)")
    g.add_argument("--host", metavar="HOST", default=None,
                   help="interface to listen on; with a loopback one, a local Ray listens on loopback only (default: 127.0.0.1)")
    g.add_argument("--port", type=int, metavar="PORT", default=None, help="default: 8000")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="clients must send Authorization: Bearer KEY (default: $SPECRAY_API_KEY, else open)")
    g.add_argument("--num-replicas", type=int, metavar="N", default=None,
                   help="engine replicas, each with its own models (default: 1)")
    g.add_argument("--max-sequences-per-request", type=int, metavar="N", default=None,
                   help="most sequences (prompts x n) one request may ask for; more is a 400 before anything runs "
                        "(default: 4096)")
    g.add_argument("--max-waiting-sequences", type=int, metavar="N", default=None,
                   help="while more sequences wait in a replica than this, new requests get 503 with Retry-After; "
                        "a request that finds none waiting is always taken whole (default: 2048)")
    g.add_argument("--graceful-shutdown-s", type=float, metavar="SECONDS", default=None,
                   help="on SIGINT/SIGTERM: new requests get 503, requests in flight get this long to finish, "
                        "then end with an error event (default: 2)")
    add_tool_flags(g)
    g.add_argument("--address", metavar="ADDRESS", default=None,
                   help="join this Ray cluster (default: start a local Ray, stopped on exit)")
    g.add_argument("--once", metavar="PROMPT", default=None,
                   help="answer one completion for PROMPT over HTTP, print it, and exit")


def add_tool_flags(g) -> None:
    """vLLM's tool-calling flags (serve, jobs; docs/tool-calling.md)."""
    from specray.protocol.tool_parsers import PARSER_NAMES

    g.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                   help="tool_choice 'auto' (the default when a request gives tools): the calls the model writes "
                        "come back as tool_calls, read by --tool-call-parser (default: off, such requests get 400)")
    g.add_argument("--tool-call-parser", metavar="NAME", default=None,
                   help=f"how the model writes calls: {', '.join(PARSER_NAMES)} (vLLM's names; hermes: Qwen2.5/3 "
                        "and Hermes; llama3_json: Llama 3.1/3.2)")


def config_data(args: argparse.Namespace, file_data: dict) -> dict:
    """The file's config with the flags given laid over it (both in vLLM's flat names or
    the nested layout; ``ServeConfig`` maps them)."""
    from specray.serve.config import flat_to_nested

    keys = ("target", "tokenizer", "dtype", "device", "step", "max_model_len", "max_num_seqs", "gpu_memory_utilization",
            "tensor_parallel_size",
            "speculative_config", "served_model_name", "host", "port", "api_key", "num_replicas", "online_learning",
            "max_sequences_per_request", "max_waiting_sequences", "graceful_shutdown_s", "block_size",
            "kv_cache_memory_bytes", "num_gpu_blocks_override", "enable_prefix_caching", "paged_kv", "grammar_drafter",
            "quantization",
            "draft_quantization", "fp8_kernel", "enable_auto_tool_choice", "tool_call_parser", *checkpoint_keys())
    flags = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "enforce_eager", None):
        if flags.get("step", "eager") != "eager":
            raise ValueError(f"--enforce-eager runs the eager step, but --step is {flags['step']}; give one of them")
        flags["step"] = "eager"
    return _merge(flat_to_nested(file_data), flat_to_nested(flags))


WHOLE = ("default_speculation", "speculative_config")
"""Settings a flag replaces whole: a speculation is one method's options, never a mix of two."""


def _merge(base: dict, over: dict) -> dict:
    """``over`` laid on ``base``: sections (engine, checkpoints, online_learning, ...) merge key by
    key, so ``--online-learning`` keeps the file's ``online_learning:`` settings; a value, and a
    speculation (``WHOLE``), replaces."""
    out = dict(base)
    for key, value in over.items():
        section = key not in WHOLE and isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if section else value
    return out


def load_config_file(path: str | None, flag: str = "--config") -> dict:
    if path is None:
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{flag} {path}: does not parse: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {path}: must hold a mapping of option names to values")
    return data


def tokenizer_dir_problem(path: str) -> str | None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return f"no tokenizer files in it ({', '.join(names)})"
    return None


def check_paths(engine) -> None:
    """One line per wrong path, naming its flag (before anything loads): a missing directory,
    a checkpoint without config.json, a tokenizer directory without tokenizer files."""
    paths = {"--target": engine.target, "--draft": engine.draft, "--medusa": engine.medusa,
             "--tokenizer": engine.tokenizer, **{f"--{k}": v for k, v in engine.checkpoints.items()}}
    for flag, path in paths.items():
        if path is None:
            continue
        if not os.path.isdir(path):
            what = "no such directory" if not os.path.exists(path) else "not a directory"
            raise ValueError(f"{flag} {path}: {what}")
        if flag in ("--target", "--draft") and not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"{flag} {path}: not a Hugging Face checkpoint (no config.json in it)")
    if engine.tokenizer is not None and (problem := tokenizer_dir_problem(engine.tokenizer)):
        raise ValueError(f"--tokenizer {engine.tokenizer}: {problem}")


def check_weights(engine, args=None, file_data: dict | None = None) -> None:
    """The weights ``engine`` (a whole SpecrayConfig: the demo pair filled in) names, checked
    from their configs and tensor headers before anything starts (``engine/checkpoints.py``):
    one line naming each flag whose directory is wrong."""
    from specray.engine.checkpoints import checkpoint_problems, problems_line

    from specray.engine.tensor_parallel import check_splits

    problems = checkpoint_problems(engine.engine_config())
    if problems:
        raise ValueError(problems_line(problems, speculative_model=_speculative_model(args, file_data or {})))
    check_splits(engine.engine_config())  # a target that cannot be split over --tensor-parallel-size
    check_default_speculation(engine)


def check_default_speculation(engine) -> None:
    """``--speculative-config`` checked against the weights it will run with (k against a
    DFlash block, a tree against the context, ...), as every request's speculation is."""
    from specray.policies.registry import validate_speculation
    from specray.protocol.checks import facts_for

    if engine.default_speculation is None:
        return
    try:
        validate_speculation(engine.default_speculation, facts_for(engine, None).limits)
    except ValueError as exc:
        raise ValueError(f"--speculative-config: {one_line(exc)}") from None


def check_tokenizer(engine) -> None:
    """A server tokenizes text prompts (its warm-up request is one): a target without
    tokenizer files needs ``--tokenizer``."""
    if engine.tokenizer is None and engine.target is not None and tokenizer_dir_problem(engine.target):
        raise ValueError(f"--target {engine.target} has no tokenizer (tokenizer.json, tokenizer_config.json, "
                         f"tokenizer.model or vocab.json): give --tokenizer DIR")


STRUCTURED_FLAGS = {"json_schema": "--json-schema", "json_object": "--json-object", "regex": "--regex",
                    "choice": "--choice", "grammar": "--grammar"}


def structured_output(args):
    """generate's structured-output flags as the request's constraint (None without one)."""
    from specray.engine.params import StructuredOutputs

    if getattr(args, "json_schema", None):
        try:
            schema = json.loads(Path(args.json_schema).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc}") from None
        return StructuredOutputs(json=schema)
    if getattr(args, "json_object", False):
        return StructuredOutputs(json_object=True)
    if getattr(args, "regex", None) is not None:
        return StructuredOutputs(regex=args.regex)
    if getattr(args, "choice", None):
        if any(c == "" for c in args.choice):
            raise ValueError("--choice: choices must be non-empty")
        return StructuredOutputs(choice=args.choice)
    if getattr(args, "grammar", None):
        try:
            return StructuredOutputs(grammar=Path(args.grammar).read_text())
        except OSError as exc:
            raise ValueError(f"--grammar {args.grammar}: {exc}") from None
    return None


def check_structured_output(engine, args, constraint) -> None:
    """The constraint compiles against the model's tokenizer, before any weight loads."""
    if constraint is None:
        return
    from specray.engine.config import load_tokenizer
    from specray.engine.grammar import GrammarError, Grammars

    flag = STRUCTURED_FLAGS["json_schema" if constraint.kind == "json" else constraint.kind]
    tokenizer = load_tokenizer(engine.tokenizer or engine.target)
    try:
        Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id).source(constraint.kind, constraint.value)
    except GrammarError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _speculative_model(args, file_data: dict) -> str | None:
    """The ``model`` of the --speculative-config given (flag or file), if any."""
    value = getattr(args, "speculative_config", None) or file_data.get("speculative-config") or file_data.get(
        "speculative_config")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value.get("model") if isinstance(value, dict) else None


# -- per-request speculation flags (generate) -------------------------------------------------
@dataclass(frozen=True)
class OptionFlag:
    field: str
    flag: str
    methods: tuple[str, ...]
    dest: str


def add_speculation_flags(p: argparse.ArgumentParser, taken: set[str]) -> list[OptionFlag]:
    """One flag per option field of the registered methods, shared by the methods whose field
    has the same type; a name taken by another flag, or by the same field of another type in
    another method, gets its method's prefix (``--eagle-top-k``, ``--suffix-tree``). List
    fields take JSON; Literals, choices; booleans are ``--x/--no-x``."""
    import specray.policies  # noqa: F401

    fields: dict[tuple[str, str], list[str]] = {}
    for method in registered_methods():
        if method == PLAIN:  # plain decoding's k is accepted but unused: not an option of it
            continue
        for name, info in method_spec(method).options.model_fields.items():
            if name != "method":
                fields.setdefault((name, repr(info.annotation)), []).append(method)
    g = p.add_argument_group("speculation options", "each belongs to the methods named; a flag of another "
                             "method than the request's is an error")
    out, named = [], set()
    for (name, _), methods in fields.items():
        flag = flag_name(name)
        if flag in taken or name in named:
            flag = f"--{methods[0]}-{name.replace('_', '-')}"
        named.add(name)
        info = method_spec(methods[0]).options.model_fields[name]
        kwargs = _argument(name, info)
        kwargs["help"] = _option_help(name, methods)
        dest = "spec_" + flag.removeprefix("--").replace("-", "_")
        g.add_argument(flag, dest=dest, default=None, **kwargs)
        out.append(OptionFlag(name, flag, tuple(methods), dest))
    return out


def _argument(name: str, info) -> dict:
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return {"choices": list(typing.get_args(annotation))}
    kinds = [a for a in typing.get_args(annotation) or (annotation,) if a is not type(None)]
    kind = kinds[0] if kinds else str
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is typing.Literal:
        return {"choices": list(typing.get_args(kind))}
    if typing.get_origin(kind) in (list, tuple) or kind in (list, dict):
        return {"type": _json, "metavar": "JSON"}
    if kind is int:
        return {"type": int, "metavar": "N"}
    if kind is float:
        return {"type": float, "metavar": "X"}
    return {"type": str, "metavar": "NAME" if name == "tree" else "VALUE"}


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg}") from None


def _option_help(name: str, methods: list[str]) -> str:
    """'draft, ngram: <description> (default: ...)', per method where they differ."""
    described = {}
    for m in methods:
        info = method_spec(m).options.model_fields[name]
        default = "self-tuning" if name == "num_speculative_tokens" else _shown(info.default)
        described.setdefault((info.description or name, default), []).append(m)
    parts = [f"{', '.join(ms)}: {desc.rstrip('.')} (default: {default})" for (desc, default), ms in described.items()]
    return "; ".join(parts).replace("%", "%%")


def _shown(value) -> str:
    if value is None:
        return "the method's own"
    if isinstance(value, bool):
        return "on" if value else "off"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def given_options(args: argparse.Namespace, flags: list[OptionFlag]) -> list[tuple[OptionFlag, object]]:
    """The option flags given on the command line, with their values."""
    return [(f, getattr(args, f.dest)) for f in flags if getattr(args, f.dest) is not None]


def check_method_flags(method: str, given: list[tuple[OptionFlag, object]], how: str) -> None:
    """A flag of a method the request does not use is an error (``how``: where the method came from)."""
    for flag, _ in given:
        if method not in flag.methods:
            raise ValueError(f"{flag.flag} is an option of {', '.join(flag.methods)}, but the method is {method} "
                             f"({how}); add --method {flag.methods[0]} or drop {flag.flag}")


def engine_settings(args, file_data: dict):
    """The SpecrayConfig that --config and the model flags describe, paths and device checked
    (one line naming the flag for anything wrong)."""
    from pydantic import ValidationError

    from specray.engine.config import check_device
    from specray.serve.config import ServeConfig

    try:
        cfg = ServeConfig.model_validate(config_data(args, file_data))
    except ValidationError as exc:
        raise ValueError(one_line(exc)) from None
    check_paths(cfg.engine)
    check_device(cfg.engine.device)
    return cfg
