"""The garbage collector's pauses, made short on a serving process by freezing what was loaded
before it serves.

A full (generation 2) collection walks every tracked object of the process: with torch,
transformers and a loaded engine, a few hundred thousand objects, many steps' time on a CPU,
falling on whichever step allocates at the wrong moment (the verification budget's cost table
keeps medians, so one such step does not set a price).
"""

from __future__ import annotations

import gc


def freeze_loaded_heap() -> None:
    """Collect once, then move every object alive now (modules, weights' wrappers, the engine)
    out of the collector's reach: later full collections walk only what serving allocated,
    as vLLM does once its engine has started. Only for a process that serves from here on:
    a frozen object that becomes garbage in a reference cycle is never collected."""
    gc.collect()
    gc.freeze()
