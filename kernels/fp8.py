"""FP8 (float8_e4m3fn) weights: quantize, dequantize, and the FP8 x FP8 matmul on GPUs that have one.

A weight ``W`` [out, in] is stored as ``q = W / s`` in float8_e4m3fn (1 byte an element) beside
its float32 scale ``s``, and read back as ``q * s``. The scale comes in the three granularities
published checkpoints use (vLLM and transformers read the same):

* per tensor:  ``s`` is [] or [1] (vLLM's ``fp8`` method, compressed-tensors ``strategy: tensor``);
* per channel: ``s`` is [out, 1] or [out], one per output row (Meta's ``fbgemm_fp8``,
  compressed-tensors ``strategy: channel``, and what ``quantize_per_channel`` makes);
* per block:   ``s`` is [ceil(out / bh), ceil(in / bw)], one per bh x bw tile (``fp8`` with
  ``weight_block_size``, stored as ``weight_scale_inv``: despite the name it multiplies too).

``dequantize`` is the reference (weight-only FP8, "W8A16": any device, any compute dtype);
``scaled_mm_linear`` quantizes activations per token as well and multiplies in FP8 with
``torch._scaled_mm`` ("W8A8"), which only CUDA devices of compute capability 8.9 and newer run.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row of zeros gets this scale (any positive number reads it back as zeros), never 0/0.
_TINY = 1e-12
SCALED_MM_CAPABILITY = (8, 9)  # Ada and Hopper: the first with FP8 tensor cores
_SCALED_MM_ALIGN = 16  # torch._scaled_mm wants both matrix dimensions of the weight divisible by 16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] (any float dtype) -> (q [out, in] float8_e4m3fn, scale [out, 1] float32),
    each row scaled so that its largest magnitude lands on FP8's largest value (448).

    >>> q, s = quantize_per_channel(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    >>> dequantize(q, s).tolist()
    [[1.0, -2.0], [0.5, 0.25]]
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_TINY)  # [out, 1]
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """q [out, in] float8 and its scale (per tensor, per channel, or per block of ``block`` =
    (bh, bw)) -> the weight [out, in] in float32."""
    out, inp = q.shape
    w = q.float()
    scale = scale.float()
    if block is not None:
        bh, bw = block
        if scale.shape != ((out + bh - 1) // bh, (inp + bw - 1) // bw):
            raise ValueError(f"block scales of a [{out}, {inp}] weight in {bh}x{bw} tiles must be "
                             f"[{(out + bh - 1) // bh}, {(inp + bw - 1) // bw}], got {list(scale.shape)}")
        full = scale.repeat_interleave(bh, dim=0)[:out].repeat_interleave(bw, dim=1)[:, :inp]  # [out, in]
        return w * full
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.numel() == out:
        return w * scale.reshape(out, 1)
    raise ValueError(f"a scale of shape {list(scale.shape)} fits neither a tensor (1), nor the {out} rows of "
                     f"a [{out}, {inp}] weight; block scales need the block size")


def scale_kind(scale_shape: tuple[int, ...], weight_shape: tuple[int, int], block: tuple[int, int] | None) -> str:
    """"tensor", "channel" or "block": how a scale of ``scale_shape`` covers a weight; ValueError
    when it covers it in none of these ways (checked from file headers, before loading)."""
    out, inp = weight_shape
    numel = 1
    for n in scale_shape:
        numel *= n
    if block is not None:
        bh, bw = block
        if tuple(scale_shape) == ((out + bh - 1) // bh, (inp + bw - 1) // bw):
            return "block"
    elif numel == 1:
        return "tensor"
    elif tuple(scale_shape) in ((out,), (out, 1)):
        return "channel"
    raise ValueError(f"its scale {list(scale_shape)} fits a [{out}, {inp}] weight neither per tensor, per "
                     f"channel" + (f" nor per {block[0]}x{block[1]} block" if block else ""))


def scaled_mm_problem(device: torch.device | str) -> str | None:
    """Why ``scaled_mm_linear`` cannot run on ``device`` (None: it can)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FP8 matmuls (torch._scaled_mm) need a CUDA GPU; this device is {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available to this torch"
    cap = torch.cuda.get_device_capability(device)
    if cap < SCALED_MM_CAPABILITY:
        return (f"FP8 matmuls need compute capability {SCALED_MM_CAPABILITY[0]}.{SCALED_MM_CAPABILITY[1]} or newer "
                f"(Ada, Hopper); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def scaled_mm_fits(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether ``scaled_mm_linear`` takes this weight (per-tensor or per-channel scales, both
    dimensions divisible by 16); others are multiplied by ``dequantize``."""
    out, inp = q.shape
    return block is None and out % _SCALED_MM_ALIGN == 0 and inp % _SCALED_MM_ALIGN == 0 and \
        scale.numel() in (1, out)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32): one scale per row (token),
    computed from the row itself (dynamic activation quantization)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_TINY)  # [M, 1]
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_linear(
    x: torch.Tensor,  # [..., K] bfloat16/float16 activations
    q: torch.Tensor,  # [N, K] float8_e4m3fn weight
    scale: torch.Tensor,  # [] / [1] / [N] / [N, 1] float32 weight scale
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N] in x's dtype
    """``x @ (q * scale).T + bias`` with FP8 activations (per-token scales) and one FP8 x FP8
    matmul on the tensor cores (W8A8). Only where ``scaled_mm_problem`` is None and
    ``scaled_mm_fits``; rounding differs from ``dequantize``'s path (the activations lose bits)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = q.shape[0]
    xq, x_scale = quantize_per_token(x.reshape(-1, k))  # [M, K], [M, 1]
    w_scale = scale.float().reshape(-1)
    w_scale = (w_scale.expand(n) if w_scale.numel() == 1 else w_scale).reshape(1, n).contiguous()  # [1, N]
    # q.t() is [K, N] column-major: the layout _scaled_mm wants for its second operand.
    out = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)  # [M, N]
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, n)
