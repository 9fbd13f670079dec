"""The garbage collector's pauses: measured, so that a step's cost leaves them out, and made
short on a serving process by freezing what was loaded before it serves.

A full (generation 2) collection walks every tracked object of the process: with torch,
transformers and a loaded engine, a few hundred thousand objects, many steps' time on a CPU.
That pause falls on whichever step allocates at the wrong moment. The
speculation-length controller timed such a step as drafting's cost and switched a paying
drafter off for the rest of the run (``test_a_gc_pause_is_not_a_steps_cost`` in tests/test_controller.py).
"""

from __future__ import annotations

import gc
import threading
import time

_local = threading.local()


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _local.start = time.perf_counter()
    elif getattr(_local, "start", None) is not None:
        _local.total = getattr(_local, "total", 0.0) + time.perf_counter() - _local.start
        _local.start = None


def gc_seconds() -> float:
    """Seconds the collector has paused the calling thread since this was first called
    (collections run in the thread whose allocation triggered them)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    return getattr(_local, "total", 0.0)


def freeze_loaded_heap() -> None:
    """Collect once, then move every object alive now (modules, weights' wrappers, the engine)
    out of the collector's reach: later full collections walk only what serving allocated,
    as vLLM does once its engine has started. Only for a process that serves from here on:
    a frozen object that becomes garbage in a reference cycle is never collected."""
    gc.collect()
    gc.freeze()
