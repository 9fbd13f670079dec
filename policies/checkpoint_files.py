"""Reading the files of a head or drafter checkpoint directory (Medusa, EAGLE, EAGLE-3,
ReDrafter): its config.json and its one weights file, with typed errors that name the file."""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

import torch


def read_json_config(directory: str | pathlib.Path, what: str) -> tuple[dict, pathlib.Path]:
    """(config.json as a dict, its path); FileNotFoundError/ValueError naming ``what`` was expected."""
    cfg_file = pathlib.Path(directory) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: not {what} directory")
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{cfg_file} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{cfg_file} must hold a JSON object")
    return raw, cfg_file


def read_tensors(directory: str | pathlib.Path, names: Sequence[str]) -> tuple[dict, pathlib.Path]:
    """(name -> tensor, the file) from the first of ``names`` present: safetensors, else a
    torch pickle read with ``weights_only``."""
    path = pathlib.Path(directory)
    weights = next((path / f for f in names if (path / f).is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"no {' or '.join(names)} in {path}")
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(weights))
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which one
        raise ValueError(f"{weights} is not a readable weights file: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{weights} holds a {type(state).__name__}, not a dict of tensors")
    return state, weights
