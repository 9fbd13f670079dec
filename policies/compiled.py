"""A proposer's own forwards compiled the way the target's fixed-shape forward is
(``engine/graphs.py``): ``torch.compile(dynamic=True, fullgraph=True)``, one graph per
function for every batch size, no recompiles as sizes change.

Dynamo specializes sizes 0 and 1, so callers pad the dimensions that can be 1 (the batch)
to at least 2 (``at_least_two``). Module guards are skipped, as the target's are: the
weights are held in place (a hot swap copies into them, ``engine/drafter_versions.py``),
so checking every parameter per call would only cost time.
"""

from __future__ import annotations

import functools
import os
import time
import types
from contextlib import contextmanager

import torch


class _Clock:
    """Seconds spent inside compiled callables while ``timing()`` is on (the benchmarks'
    host share of a step: its wall time minus this)."""

    on = False
    seconds = 0.0
    calls = 0


CLOCK = _Clock()


@contextmanager
def timing():
    """Count the time inside compiled callables in the block: ``with timing() as clock: ...;
    clock.seconds``."""
    CLOCK.on, CLOCK.seconds, CLOCK.calls = True, 0.0, 0
    try:
        yield CLOCK
    finally:
        CLOCK.on = False


def timed(fn):
    """``fn``, its calls counted by ``timing``."""
    def call(*args, **kwargs):
        if not CLOCK.on:
            return fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK.seconds += time.perf_counter() - start
            CLOCK.calls += 1

    return call


# Floats and ints read from modules and runners (an RMSNorm's eps, attention's scaling, the
# cache's capacity) are constants of the graph, not inputs: unspecialized (torch's default
# under dynamic=True), each float became a 0-d tensor built on every call, three per decoder
# layer, read by the kernels at run time, and each int one more argument the C++ wrapper turns
# into a tensor per call. Modules and runners never change after start-up (their guards are
# skipped for the same reason); tensor sizes stay symbolic. Dynamo reads this config when it
# traces: at a compiled function's first call, the one run under it (so later calls enter no
# config patch; a recompile, which the engine's tests forbid, would only take them as inputs
# again). The invariant this needs: a number a
# module holds is never changed after a graph first ran it (module guards are skipped, so
# the graph would keep the old value); hot swaps copy tensors (``load_state_dict``), and a
# change of such a number needs a new compiled function.
def _constants():
    # torch._dynamo is imported here, at a first trace, not with this module: importing it
    # costs about 2 s of CPU, paid by every actor process that imports a policy otherwise.
    import torch._dynamo

    return torch._dynamo.config.patch(specialize_float=True, specialize_int=True)


BACKEND_ENV = "SPECRAY_COMPILE_BACKEND"
"""torch.compile's backend for the ``compile`` step: inductor (the default: generated kernels)
or another of torch's, e.g. ``aot_eager``, which captures the same graphs (graph breaks and
recompiles show the same) and runs them without code generation — for finding a capture
problem, and for tests whose subject is the capture, not inductor's kernels."""


def compiled(fn, device):
    """``fn`` under ``torch.compile(dynamic=True, fullgraph=True)`` with ``compile_options``,
    the numbers it reads from modules specialized, its calls counted by ``timing``."""
    backend = os.environ.get(BACKEND_ENV, "inductor")
    options = compile_options(device) if backend == "inductor" else {
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    graph = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend, options=options)
    traced = False

    def call(*args, **kwargs):
        nonlocal traced
        if traced:
            return graph(*args, **kwargs)
        with _constants():
            out = graph(*args, **kwargs)
        traced = True  # (after a first call that raised, the next one traces under it again)
        return out

    return timed(call)


def compile_options(device) -> dict:
    """Inductor's options for a step's graphs on ``device``. On a CPU the wrapper that calls
    the generated kernels is C++ (``cpp_wrapper``): a small model's forward is a few hundred
    kernel and matmul calls, and calling them from Python cost a third of the compiled
    forward here (4.8 against 7.2 ms of CPU time for the demo target, in one loaded run)."""
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if torch.device(device).type == "cpu":
        options["cpp_wrapper"] = True
    return options


_INFERENCE_MODE = getattr(torch._C, "_InferenceMode", None) or torch.inference_mode


def inference(fn):
    """``fn`` under ``torch.inference_mode()``, entered only where it is not on already: a
    verification enters it once (``engine/device_step.py``), and the forwards it calls do not
    build and tear down a context of their own, host time on every step. It enters torch's
    own guard, the one ``torch.inference_mode`` enters, without that class's Python layers."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with _INFERENCE_MODE(True):
            return fn(*args, **kwargs)

    return call


def compile_fn(fn, device="cpu"):
    """``fn`` compiled with dynamic shapes into one graph (its calls counted by ``timing``).

    A bound method (a module's forward) gets a code object of its own: dynamo caches graphs
    per code object, and with module guards skipped, two instances of one class (two
    engines' heads, of other shapes) must not share one."""
    torch.fx.experimental._config.use_duck_shape = False  # no size tied to another (see graphs.py)
    if isinstance(fn, types.MethodType):
        func = fn.__func__
        own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                                 func.__closure__)
        fn = types.MethodType(own, fn.__self__)
    return compiled(fn, device)


def at_least_two(x: torch.Tensor) -> torch.Tensor:
    """x [n, ...] padded with zero rows to n >= 2 (a compiled graph never sees a batch of 1)."""
    if x.shape[0] >= 2:
        return x
    return torch.cat([x, x.new_zeros(2 - x.shape[0], *x.shape[1:])])
