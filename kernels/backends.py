"""Which attention kernel runs, decided by running it once (not by importing it).

xformers is optional. A wheel from PyPI imports fine on a CUDA machine and still has no CUDA
kernels ("xFormers wasn't build with CUDA support"), so "it imports" is no test: the probe
runs one tiny ``memory_efficient_attention`` call with an additive bias — the exact call
``kernels/attention.py`` makes — on the GPU, and checks it against PyTorch's SDPA. The
answer is cached for the process and said once at start-up (``specray serve``, ``specray env``).

``SPECRAY_ATTENTION``: ``auto`` (default: xformers where its CUDA kernels run, else SDPA),
``sdpa`` (always PyTorch's kernels), ``xformers`` (fail at start-up if they do not run).
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import torch

ENV = "SPECRAY_ATTENTION"
CHOICES = ("auto", "sdpa", "xformers")


@lru_cache(maxsize=None)
def attention_backend(device_type: str = "cuda") -> tuple[str, str]:
    """(kernel, why) for attention on ``device_type`` ("cuda" or "cpu"): "xformers" or "sdpa".

    >>> attention_backend("cpu")
    ('sdpa', 'PyTorch SDPA: xformers has no CPU kernels')
    """
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: use one of {', '.join(CHOICES)}")
    if device_type != "cuda":
        return "sdpa", "PyTorch SDPA: xformers has no CPU kernels"
    if choice == "sdpa":
        return "sdpa", f"PyTorch SDPA: {ENV}=sdpa"
    if not torch.cuda.is_available():
        return "sdpa", "PyTorch SDPA: CUDA is not available"
    problem = _probe_xformers()
    if problem is None:
        import xformers

        return "xformers", f"xformers {xformers.__version__}: memory_efficient_attention ran on this GPU"
    if choice == "xformers":
        raise RuntimeError(f"{ENV}=xformers, but {problem}")
    return "sdpa", f"PyTorch SDPA: {problem}"


def _probe_xformers() -> str | None:
    """None if xformers' fused attention runs here and agrees with SDPA; else why not."""
    logging.getLogger("xformers").setLevel(logging.ERROR)  # its import warns on builds without CUDA
    try:
        import xformers.ops as xops
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken build failing at import
        return (f"xformers is not installed ({type(exc).__name__}; it is optional: "
                "pip install 'specray[xformers]' on a CUDA machine)")
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, 3, 2, 64, device="cuda", dtype=torch.float16, generator=gen) for _ in range(3))
        bias = torch.zeros(1, 2, 3, 8, device="cuda", dtype=torch.float16)[..., :3]  # 8-aligned, as attention.py pads
        bias[..., 2] = torch.finfo(torch.float16).min
        out = xops.memory_efficient_attention(q, k, v, attn_bias=bias)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias).transpose(1, 2)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - "No operator found", "wasn't build with CUDA support", ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"xformers' CUDA kernels do not run here ({first[:160]})"
    if not torch.allclose(out.float(), ref.float(), atol=1e-2):
        return "xformers' attention disagrees with SDPA on this GPU"
    return None
