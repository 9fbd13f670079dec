"""Reading the files of a head or drafter checkpoint directory (Medusa, EAGLE, EAGLE-3,
ReDrafter): its config.json and its one weights file, with typed errors that name the file.

A loader given ``described=True`` checks a directory without loading it: it reads the
tensors' headers (``read_tensors(..., described=True)``: large tensors on the ``meta``
device), builds its module on the meta device (``building``) and assigns them, so every shape
and name check of a real load runs and no weight is read (``MethodSpec.inspect``). Draft and
target models are described by ``tensor_shapes``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from typing import Sequence

import torch


def read_json_config(directory: str | pathlib.Path, what: str) -> tuple[dict, pathlib.Path]:
    """(config.json as a dict, its path); FileNotFoundError/ValueError naming ``what`` was expected."""
    cfg_file = pathlib.Path(directory) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: not {what} directory")
    return read_json_config_file(cfg_file)


def read_json_config_file(cfg_file: pathlib.Path) -> tuple[dict, pathlib.Path]:
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object")
    return raw, cfg_file


SMALL_TENSOR = 1 << 20
"""Elements: with ``described=True`` tensors up to this size are read (checks may read their
values, e.g. a vocabulary map); larger ones are only described (shape and dtype)."""


def read_tensors(directory: str | pathlib.Path, names: Sequence[str],
                 described: bool = False) -> tuple[dict, pathlib.Path]:
    """(name -> tensor, the file) from the first of ``names`` present: safetensors, else a
    torch pickle read with ``weights_only``. ``described``: large tensors come back on the
    ``meta`` device (their shape and dtype from the file's header, nothing read), so that a
    loader run on them checks a checkpoint's layout without loading it."""
    path = pathlib.Path(directory)
    weights = next((path / f for f in names if (path / f).is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"no {' or '.join(names)} in {path}")
    try:
        state = _read(weights, described)
    except Exception as exc:  # a truncated or foreign file: say which one
        raise ValueError(f"{weights} is not a readable weights file: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{weights} holds a {type(state).__name__}, not a dict of tensors")
    return state, weights


def _read(weights: pathlib.Path, described: bool):
    if weights.suffix == ".safetensors":
        if not described:
            from safetensors.torch import load_file

            return load_file(str(weights))
        from safetensors import safe_open

        state = {}
        with safe_open(str(weights), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                shape = part.get_shape()
                if math.prod(shape) <= SMALL_TENSOR:
                    state[name] = f.get_tensor(name)
                else:
                    state[name] = torch.empty(shape, dtype=_DTYPES.get(part.get_dtype(), torch.float32), device="meta")
        return state
    try:  # a pickle: mapped, so only what is read below (small tensors) leaves the disk
        state = torch.load(weights, map_location="cpu", weights_only=True, mmap=described)
    except RuntimeError:  # an old (non-zip) pickle cannot be mapped: read it
        state = torch.load(weights, map_location="cpu", weights_only=True)
    if described and isinstance(state, dict):
        state = {k: v.to("meta") if isinstance(v, torch.Tensor) and v.numel() > SMALL_TENSOR else v
                 for k, v in state.items()}
    return state


def load_weights(module: torch.nn.Module, state: dict, described: bool, what: str) -> None:
    """``module.load_state_dict(state)``, or one bounded line saying what does not fit: the
    tensors missing, those it does not know, those of another shape (a few names each)."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unknown = [k for k in state if k not in own]
    misshapen = [f"{k} is {list(state[k].shape)}, needs {list(own[k].shape)}" for k in own
                 if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    parts = [f"{len(names)} {label if len(names) > 1 else one} ({_few(names)})" for names, label, one in
             ((missing, "tensors missing", "tensor missing"), (unknown, "tensors it does not know",
              "tensor it does not know"), (misshapen, "of another shape", "of another shape")) if names]
    if parts:
        raise ValueError(f"{what}: " + "; ".join(parts))
    module.load_state_dict(state, assign=described)


def _few(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f", ... {len(names) - most} more" if len(names) > most else "")


def building(described: bool):
    """Where a loader builds its module: on the meta device when it only checks a checkpoint."""
    return torch.device("meta") if described else contextlib.nullcontext()


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_DTYPES = {k: getattr(torch, v) for k, v in _SAFETENSORS_DTYPES.items()}


def tensor_shapes(directory: str | pathlib.Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a Hugging Face checkpoint directory, from the files'
    headers (``model.safetensors``, its shards by ``model.safetensors.index.json``, or
    ``pytorch_model.bin`` and its shards, mapped): nothing is loaded. FileNotFoundError when
    the directory holds none of them."""
    return {name: shape for name, (shape, _) in tensor_headers(directory).items()}


def tensor_headers(directory: str | pathlib.Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, torch dtype name such as ``bfloat16`` or ``float8_e4m3fn``) of every tensor
    of a checkpoint directory, as ``tensor_shapes`` reads them (headers only)."""
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in weight_files(pathlib.Path(directory)):
        try:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(file), framework="pt") as f:
                    for k in f.keys():
                        part = f.get_slice(k)
                        kind = part.get_dtype()
                        headers[k] = (tuple(part.get_shape()), _SAFETENSORS_DTYPES.get(kind, kind))
            else:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                headers.update({k: (tuple(v.shape), str(v.dtype).removeprefix("torch."))
                                for k, v in state.items() if isinstance(v, torch.Tensor)})
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which one
            raise ValueError(f"{file} is not a readable weights file: {' '.join(str(exc).split())[:200]}") from None
    return headers


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The weight files of a checkpoint directory: one file, or the shards its index names."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / single).is_file():
            return [path / single]
        if (path / index).is_file():
            raw, _ = read_json_config_file(path / index)
            shards = sorted(set((raw.get("weight_map") or {}).values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise FileNotFoundError(f"{path / index} names shards that are not there: {missing[:3]}")
            return [path / s for s in shards]
    raise FileNotFoundError(f"no weights in {path} (model.safetensors, pytorch_model.bin, or their shards)")


def causal_lm_facts(directory: str | pathlib.Path) -> dict:
    """Check that a directory holds a whole Hugging Face causal LM — a config transformers maps
    to a ``...ForCausalLM``, and a weight of the right shape for every parameter of the model
    that config builds — from the config and the weight files' headers (the model is built on
    the meta device: nothing is loaded). ValueError says what is wrong; returns its
    ``hidden_size``, ``vocab_size`` (input embedding rows) and ``num_layers``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = pathlib.Path(directory)
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"config.json does not describe a transformers model: {' '.join(str(exc).split())[:200]}") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError:
        kind = getattr(config, "model_type", "?")
        raise ValueError(f"config.json describes a {kind!r} model, not a causal LM transformers can build") from None
    shapes = tensor_shapes(path)
    prefix = getattr(model, "base_model_prefix", "") or ""
    # A checkpoint may spell names with or without the base model's prefix (GPT-2's own does not).
    present = {**{f"{prefix}.{k}": s for k, s in shapes.items() if prefix}, **shapes}
    groups: dict[int, list[str]] = {}  # tied parameters are one object under several names
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing, wrong = [], []
    for names in groups.values():
        found = next((n for n in names if n in present), None)
        if found is None:
            missing.append(names[0])
        elif tuple(present[found]) != tuple(params[found].shape):
            wrong.append(f"{found} is {list(present[found])}, the config needs {list(params[found].shape)}")
    if wrong:
        raise ValueError(f"weights of the wrong shape for its config.json: {'; '.join(wrong[:3])}"
                         + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    if missing:
        raise ValueError(f"not a whole {type(model).__name__}: {len(missing)} of {len(groups)} weights are missing "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"hidden_size": int(text.hidden_size), "vocab_size": int(model.get_input_embeddings().weight.shape[0]),
            "num_layers": int(getattr(text, "num_hidden_layers", 0) or 0)}


ACCEPTANCE_KEY = "specray_acceptance"
"""config.json key of a draft's measured acceptance per position (given the one before), saved
by training (``specray train``) and by the demo pair; the self-tuning controller starts from it."""


def measured_acceptance(directory: str | pathlib.Path | None) -> list[float] | None:
    """The acceptance a checkpoint directory's config.json says was measured, if it says (and
    it is a list of rates in [0, 1]); None otherwise, never an error."""
    if directory is None:
        return None
    try:
        raw, _ = read_json_config(directory, "a checkpoint")
    except (OSError, ValueError):
        return None
    rates = raw.get(ACCEPTANCE_KEY)
    ok = isinstance(rates, list) and rates and all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates)
    return [float(r) for r in rates] if ok else None


def save_acceptance(directory: str | pathlib.Path, rates: Sequence[float], **extra) -> None:
    """Write ``rates`` (and ``extra`` keys) into a checkpoint directory's config.json (written
    aside, then renamed: a reader never sees half a file)."""
    raw, cfg_file = read_json_config(directory, "a checkpoint")
    raw[ACCEPTANCE_KEY] = [round(float(r), 3) for r in rates]
    raw.update(extra)
    partial = cfg_file.with_name(f".{cfg_file.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(raw, indent=2))
    partial.replace(cfg_file)
