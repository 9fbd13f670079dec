"""Probes for where a step's time goes: host reads of tensors, and a profiler summary.

``host_reads()`` counts the calls that copy a tensor's value back to the host (and on a GPU
wait for it): ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()``, ``int()``, ``float()``,
``nonzero``. Host-side structures read their CPU tensors through ``.numpy()``, which a device
tensor refuses, so they are not counted. On a CPU machine this is the proxy for the
device syncs a step would make on a GPU (tests/test_static_step.py, ``bench.gpu``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "nonzero")


@contextmanager
def host_reads():
    """Count host reads of tensors inside the block: ``with host_reads() as n: ...; n["reads"]``."""
    counts = {"reads": 0}
    patched = []

    def wrap(owner, name):
        original = getattr(owner, name)
        patched.append((owner, name, original))

        def counted(*args, **kwargs):
            counts["reads"] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    for name in READS:
        wrap(torch.Tensor, name)
    wrap(torch, "nonzero")
    try:
        yield counts
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def profile_steps(step, steps: int) -> dict:
    """Run ``step()`` ``steps`` times under torch.profiler; per step: device busy ms (kernels
    and copies), kernel launches (graph launches counted apart), device-to-host copies and
    synchronizations. CUDA only (on a CPU there is no device time to separate)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    busy_us = launches = graph_launches = d2h = syncs = 0
    for e in prof.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            busy_us += e.device_time
            if name.startswith("Memcpy DtoH"):
                d2h += 1
        elif name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
        elif name in ("cudaGraphLaunch", "cuGraphLaunch"):
            graph_launches += 1
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs += 1
    return {"device_ms": busy_us / 1e3 / steps, "launches": launches / steps,
            "graph_launches": graph_launches / steps, "d2h_copies": d2h / steps, "syncs": syncs / steps}
