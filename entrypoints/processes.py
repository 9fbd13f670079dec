"""The processes a command started, so that it leaves none behind when it stops.

A local Ray started by ``ray.init`` runs its GCS and raylet as this process's children and
every worker (replicas, proposers, tensor-parallel ranks) as the raylet's. ``ray.shutdown()``
waits for the GCS and raylet only; a worker notices its raylet is gone on its own time (one
waiting inside a collective, later), and by then it is init's child, no longer ours to find.
So the tree is read before Ray goes down and waited on (then killed) after.
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger("specray")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process alive (zombies included), from ``/proc``."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # gone meanwhile
                continue
            parents[int(entry)] = int(stat[stat.rfind(")") + 2:].split()[1])  # after the name: state, ppid
    return parents


def descendants(pid: int | None = None) -> list[int]:
    """Every process below ``pid`` (this one by default); empty where ``/proc`` is missing."""
    try:
        parents = _parents()
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(os.getpid() if pid is None else pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def reap(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    """Wait up to ``timeout_s`` for ``pids`` to exit, then SIGKILL those left (named in one
    warning); the pids that had to be killed."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    if left:
        log.warning("killed %d processes still running %.0f s after Ray stopped: %s", len(left), timeout_s, left)
    return left
