"""How many torch threads a process should run: the cores it may use that nothing else is using.

On a shared machine, a torch op split over more threads than there are idle cores waits for
its slowest thread every step: two threads beside one busy process on two cores ran many
times slower than one. So a process that picks its own count takes the cores in its
affinity mask less the machine's current load (the 1-minute load average), at least one;
an explicit count (``--threads N``) always wins and is what makes a run bit-reproducible
(reduction order depends on the thread count).

    >>> free_threads(cores=8, load=2.6)
    5
    >>> free_threads(cores=2, load=3.0)
    1
"""

from __future__ import annotations

import os


def free_threads(cores: int | None = None, load: float | None = None) -> int:
    """Threads for this process: ``cores`` (default: its CPU affinity) less ``load`` (default:
    the 1-minute load average), rounded, between 1 and ``cores``."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this platform: assume the machine is ours
            load = 0.0
    return max(1, min(cores, round(cores - load)))
