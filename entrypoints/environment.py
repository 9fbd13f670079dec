"""``specray env``: what this machine gives specray — versions, devices, the dtype ``auto``
picks, and which attention kernel runs and why (the start-up probe of ``kernels/backends.py``)."""

from __future__ import annotations

import platform
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe() -> str:
    import torch

    from specray.engine.config import resolve_device, resolve_dtype
    from specray.kernels.backends import attention_backend
    from specray.kernels.fp8 import scaled_mm_problem

    lines = [f"python        {platform.python_version()} ({platform.platform()})"]
    for dist in ("specray", "torch", "transformers", "ray", "xformers", "pydantic"):
        lines.append(f"{dist:13s} {_version(dist)}")
    cuda = torch.version.cuda or "none (a CPU build)"
    lines.append(f"torch CUDA    {cuda}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            lines.append(f"cuda:{i}        {props.name}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free), "
                         f"compute capability {props.major}.{props.minor}")
    else:
        lines.append("GPUs          none visible to torch")
    device = resolve_device("auto")
    lines.append(f"device        {device} (--device auto)")
    lines.append(f"dtype         {resolve_dtype('auto', device)} (--dtype auto: bfloat16 on CUDA, float32 on CPU)")
    kernel, why = attention_backend(device)
    lines.append(f"attention     {kernel}: {why}")
    lines.append(f"paged KV      each forward gathers its rows' blocks (block table on the device), then {kernel} "
                 "attends over them (--no-paged-kv: contiguous rows, read in place)")
    problem = scaled_mm_problem(device)
    lines.append("fp8           --quantization fp8 (or an FP8 checkpoint): weights in float8_e4m3fn, dequantized for "
                 f"each matmul on {device}; --fp8-kernel scaled_mm (W8A8): "
                 + ("available" if problem is None else f"not here: {problem}"))
    return "\n".join(lines)
