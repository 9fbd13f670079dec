"""FP8 weights: a model's linear layers stored in float8_e4m3fn, dequantized for each matmul.

Two ways in, one module (``FP8Linear``: the FP8 weight [out, in], its float32 scale, the bias in
the compute dtype):

* ``--quantization fp8`` on a bf16/fp16/fp32 checkpoint (``quantize_linears``): every linear
  layer of the decoder (``nn.Linear``, GPT-2's ``Conv1D``) is quantized at load with one scale per
  output channel, as vLLM's online ``fp8`` does. The LM head and the embeddings stay in the
  compute dtype (vLLM and the published FP8 checkpoints keep them so too; the feature-level
  drafters read the target's LM head and embedding as they are).
* A checkpoint published in FP8 loads as it is (``stored_fp8`` + ``load_stored_fp8``), whatever
  ``--quantization`` says: its ``config.json`` has a ``quantization_config`` whose ``quant_method``
  is ``fbgemm_fp8`` (Meta's Llama-3.1-FP8: per-channel ``weight_scale`` [out, 1]), ``fp8``
  (vLLM's: per-tensor ``weight_scale``, or ``weight_scale_inv`` per ``weight_block_size`` tile) or
  ``compressed-tensors`` (llm-compressor's ``float-quantized`` format: ``weight_scale`` per tensor,
  channel or block). Modules the checkpoint left unquantized (its ignore list) stay as stored;
  ``input_scale`` tensors (static activation scales) are not used by the weight-only path.

The reference computation is weight-only (W8A16): ``x @ (q * s).T`` in the compute dtype, on CPU
and GPU alike. ``fp8_kernel="scaled_mm"`` also quantizes activations per token and multiplies in
FP8 (W8A8, ``torch._scaled_mm``), only on CUDA devices of compute capability 8.9 and newer.
Speculation is lossless against the same FP8 model's plain decoding (both run these modules).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch
from torch import nn

from specray.kernels import fp8
from specray.policies.checkpoint_files import read_json_config, tensor_headers, weight_files

QUANTIZATION_METHODS = ("fp8",)  # --quantization: vLLM's names
FP8_KERNELS = ("dequantize", "scaled_mm")
_CT_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors formats storing FP8 tensors as they are
_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
_READABLE = ("specray loads FP8 checkpoints as published (quant_method fbgemm_fp8, fp8, or compressed-tensors with "
             "8-bit float weights) and quantizes unquantized ones with --quantization fp8")


class UnsupportedQuantizationError(ValueError):
    """A quantization method or a checkpoint's quantization_config specray cannot load."""


def check_method(method: str | None, what: str = "quantization") -> None:
    if method is not None and method not in QUANTIZATION_METHODS:
        raise UnsupportedQuantizationError(
            f"{what} {method!r} is not supported: specray quantizes to {', '.join(QUANTIZATION_METHODS)} "
            "(float8_e4m3fn weights with per-channel scales)")


def check_kernel(kernel: str) -> None:
    if kernel not in FP8_KERNELS:
        raise UnsupportedQuantizationError(f"fp8_kernel {kernel!r}: use one of {', '.join(FP8_KERNELS)}")


class FP8Linear(nn.Module):
    """A linear layer whose weight is stored in FP8 and dequantized for each matmul.

    weight: [out, in] float8_e4m3fn; weight_scale: [] / [out, 1] / block grid, float32 (see
    ``kernels/fp8.py``); bias: [out] in the compute dtype or None; block: (bh, bw) for block
    scales. ``kernel``: ``dequantize`` (W8A16, the reference) or ``scaled_mm`` (W8A8; a layer
    whose shape or scales ``torch._scaled_mm`` does not take dequantizes).
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 block: tuple[int, int] | None = None, kernel: str = "dequantize"):
        super().__init__()
        if weight.dtype != fp8.FP8_DTYPE:
            raise ValueError(f"FP8Linear holds {fp8.FP8_DTYPE} weights, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.block = tuple(block) if block is not None else None
        takes = kernel != "scaled_mm" or fp8.scaled_mm_fits(weight, self.weight_scale, self.block)
        self.kernel = kernel if takes else "dequantize"

    @classmethod
    def quantized(cls, module: nn.Module, kernel: str = "dequantize") -> "FP8Linear":
        """An ``nn.Linear`` (or GPT-2's ``Conv1D``, whose weight is [in, out]) quantized per output channel."""
        weight = module.weight.detach()
        if not isinstance(module, nn.Linear):  # Conv1D: x @ W + b with W [in, out]
            weight = weight.t()
        q, scale = fp8.quantize_per_channel(weight)
        return cls(q, scale, module.bias, kernel=kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.kernel == "scaled_mm":
            return fp8.scaled_mm_linear(x, self.weight, self.weight_scale, self.bias)
        w = fp8.dequantize(self.weight, self.weight_scale, self.block).to(x.dtype)  # [out, in]
        return nn.functional.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        scales = "block" if self.block else "tensor" if self.weight_scale.numel() == 1 else "channel"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scales={scales}, kernel={self.kernel}")


def _linear_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every float linear layer of a causal LM except its LM head (the output
    embeddings), which stays in the compute dtype."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and m is not head]


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def quantize_linears(model: nn.Module, kernel: str = "dequantize") -> int:
    """Quantize every float linear layer of ``model`` (not its LM head) to FP8 with per-channel
    scales, in place; returns how many."""
    check_kernel(kernel)
    layers = _linear_layers(model)
    for name, module in layers:
        _replace(model, name, FP8Linear.quantized(module, kernel))
    return len(layers)


# -- checkpoints published in FP8 --------------------------------------------------------------
@dataclass(frozen=True)
class StoredFP8:
    """How a published FP8 checkpoint stores its weights (its ``quantization_config``).

    method: quant_method as written; block: (bh, bw) for block scales, else None; activations:
    what its makers ran activations in (``dynamic``/``static`` FP8, or ``none``: W8A16) — the
    weight-only path multiplies in the compute dtype either way."""

    method: str
    block: tuple[int, int] | None = None
    activations: str = "dynamic"

    def describe(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} block scales" if self.block else "tensor/channel scales"
        return f"FP8 checkpoint ({self.method}, {scales})"


def stored_fp8(quantization_config) -> StoredFP8 | None:
    """The FP8 layout a checkpoint's ``quantization_config`` (a dict, or None) describes; None when
    there is none. UnsupportedQuantizationError for any other quantization, saying what is read."""
    if quantization_config is None:
        return None
    qc = quantization_config if isinstance(quantization_config, dict) else quantization_config.to_dict()
    method = qc.get("quant_method")
    if method == "fbgemm_fp8":
        return StoredFP8(method)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedQuantizationError(f"quantization_config: weight_block_size {block} is not two sizes")
        return StoredFP8(method, tuple(block) if block else None, qc.get("activation_scheme", "dynamic"))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise UnsupportedQuantizationError(f"its quantization_config says quant_method {method!r}: {_READABLE}")


def _compressed_tensors(qc: dict) -> StoredFP8:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise UnsupportedQuantizationError(f"compressed-tensors format {fmt!r}: {_READABLE} (formats "
                                           f"{', '.join(_CT_FORMATS)})")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors quantization_config has no config_groups")
    block, activations = None, "none"
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or not w.get("symmetric", True) or w.get("dynamic"):
            raise UnsupportedQuantizationError(
                f"compressed-tensors group {name!r} quantizes weights as {w.get('num_bits')}-bit "
                f"{w.get('type')}{' (dynamic)' if w.get('dynamic') else ''}: {_READABLE}")
        strategy = w.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise UnsupportedQuantizationError(f"compressed-tensors group {name!r}: weight strategy {strategy!r} "
                                               "(specray reads tensor, channel and block)")
        if strategy == "block":
            block = tuple(w.get("block_structure") or ())
            if len(block) != 2:
                raise UnsupportedQuantizationError(f"compressed-tensors group {name!r}: block_structure "
                                                   f"{w.get('block_structure')} is not two sizes")
        inputs = (group or {}).get("input_activations")
        if inputs:
            activations = "dynamic" if inputs.get("dynamic") else "static"
    return StoredFP8("compressed-tensors", block, activations)


def checkpoint_quantization(path: str | pathlib.Path) -> StoredFP8 | None:
    """``stored_fp8`` of a checkpoint directory's config.json (None: not quantized)."""
    raw, _ = read_json_config(path, "a checkpoint")
    return stored_fp8(raw.get("quantization_config"))


def stored_fp8_problems(path: str | pathlib.Path, stored: StoredFP8) -> list[str]:
    """What keeps a published FP8 checkpoint from loading, from its tensor headers (nothing is
    read): every FP8 tensor is an e4m3 ``.weight`` [out, in] with a scale that fits it."""
    headers = tensor_headers(path)
    problems = []
    for name, (shape, dtype) in sorted(headers.items()):
        if dtype == "float8_e5m2":
            problems.append(f"{name} is float8_e5m2: specray reads float8_e4m3fn weights")
        if dtype != "float8_e4m3fn":
            continue
        base = name.removesuffix(".weight")
        scale = next((f"{base}.{s}" for s in _SCALE_NAMES if f"{base}.{s}" in headers), None)
        if not name.endswith(".weight") or len(shape) != 2:
            problems.append(f"{name} is FP8 but not the [out, in] weight of a linear layer")
        elif scale is None:
            problems.append(f"{name} is FP8 without a {base}.weight_scale")
        else:
            try:
                fp8.scale_kind(headers[scale][0], shape, stored.block)
            except ValueError as exc:
                problems.append(f"{name}: {exc}")
    if not any(dtype == "float8_e4m3fn" for _, dtype in headers.values()):
        problems.append(f"its quantization_config says {stored.method}, but no tensor is stored in FP8")
    return problems[:3] + ([f"and {len(problems) - 3} more"] if len(problems) > 3 else [])


def load_stored_fp8(model: nn.Module, path: str | pathlib.Path, stored: StoredFP8, kernel: str = "dequantize") -> int:
    """Turn the layers a published FP8 checkpoint stores in FP8 into ``FP8Linear`` modules, in place;
    returns how many. ``model`` was loaded from ``path`` by transformers without the
    quantization_config, so each of those weights holds the stored FP8 values cast to the compute
    dtype — exactly: bf16, fp16 and fp32 represent every e4m3 value — and casting back recovers
    them; the scales are read from the files here."""
    check_kernel(kernel)
    scales = _read_scales(path)
    prefix = getattr(model, "base_model_prefix", "") or ""
    swapped = 0
    for name, module in _linear_layers(model):
        key = next((k for k in (name, name.removeprefix(prefix + ".")) if f"{k}.weight" in scales), None)
        if key is None:
            continue  # left unquantized by the checkpoint (its ignore list)
        scale = scales.pop(f"{key}.weight")
        weight = module.weight.detach()
        if not isinstance(module, nn.Linear):
            weight = weight.t()
        q = weight.to(fp8.FP8_DTYPE)
        if not torch.equal(q.to(weight.dtype), weight):  # what was loaded is not FP8 values coming back
            raise UnsupportedQuantizationError(f"{path}: {key}.weight has a scale but does not hold FP8 values")
        _replace(model, name, FP8Linear(q, scale, module.bias, block=stored.block, kernel=kernel))
        swapped += 1
    if scales:
        raise UnsupportedQuantizationError(f"{path}: scales for weights this model has no linear layer for: "
                                           f"{', '.join(sorted(scales)[:3])}")
    return swapped


def _read_scales(path) -> dict[str, torch.Tensor]:
    """weight name -> its scale (float32), from every weight file of ``path``."""
    found = {}
    for file in weight_files(pathlib.Path(path)):
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys() if k.rsplit(".", 1)[-1] in _SCALE_NAMES}
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            tensors = {k: v.clone() for k, v in state.items() if k.rsplit(".", 1)[-1] in _SCALE_NAMES}
        found.update({k.rsplit(".", 1)[0] + ".weight": v.float() for k, v in tensors.items()})
    return found


# -- what runs ---------------------------------------------------------------------------------
def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the linear layers' weights and scales, LM head excluded; bytes of every parameter
    and buffer): what the model holds in memory."""
    layers = [m for _, m in _linear_layers(model)] + [m for m in model.modules() if isinstance(m, FP8Linear)]
    linear = sum(t.nbytes for m in layers for t in (m.weight, getattr(m, "weight_scale", None)) if t is not None)
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return linear, sum(t.nbytes for t in unique.values())


def describe(model: nn.Module) -> str:
    """One line: how the model's weights are held (for start-up logs)."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    linear, total = weight_bytes(model)
    if not layers:
        return f"weights not quantized, {total / 2**20:.1f} MiB"
    kernels = sorted({m.kernel for m in layers})
    how = " + ".join("W8A8 (torch._scaled_mm)" if k == "scaled_mm" else "W8A16 (dequantized per matmul)"
                     for k in kernels)
    return (f"fp8: {len(layers)} linear layers in float8_e4m3fn, {how}; linear layers {linear / 2**20:.2f} MiB, "
            f"all weights {total / 2**20:.2f} MiB")


def describe_plan(target: str, draft: str | None, quantization: str | None, draft_quantization: str | None,
                  kernel: str) -> str:
    """One line, before anything loads: how the target's and the draft's weights will be held."""
    def plan(path: str, requested: str | None) -> str:
        try:
            stored = checkpoint_quantization(path)
        except (OSError, ValueError) as exc:
            return f"unreadable ({' '.join(str(exc).split())})"
        if stored is not None:
            return stored.describe()
        return "fp8 (quantized at load, per-channel scales)" if requested else "none"

    line = f"quantization: target {plan(target, quantization)}"
    if draft is not None:
        line += f", draft {plan(draft, draft_quantization)}"
    if "fp8" in line.lower():
        line += ("; FP8 layers multiply in FP8 (W8A8, torch._scaled_mm)" if kernel == "scaled_mm"
                 else "; FP8 layers are dequantized for each matmul (W8A16)")
    return line


def planned_weight_bytes(path: str, dtype: str, quantization: str | None) -> int | None:
    """The bytes a checkpoint's weights will take once loaded in FP8 — quantized at load, or as
    stored — computed on the meta device (nothing is read but config.json); None when it is
    neither (the caller sizes it from its files)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    stored = stored_fp8(getattr(config, "quantization_config", None))
    if stored is None and quantization is None:
        return None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        quantize_linears(model)  # a stored checkpoint's ignored layers are counted as FP8 too: a little low
    return weight_bytes(model)[1]
