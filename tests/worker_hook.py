"""The test session's Ray ``worker_process_setup_hook`` (``tests/conftest.py``).

It runs in every process of the session's cluster: Serve's controller and proxies, idle
workers, every actor. So it imports nothing unless the process was asked to serve the toy
method of ``tests/failing_method.py``: that module imports specray's policies and with them
torch, seconds of CPU for each process on 2 shared cores, and Serve's controller kills a proxy
that is not ready within its ready-check timeout (a proxy "killed by ray.kill").
"""

from __future__ import annotations

import os

PHASE_VAR = "SPECRAY_TOY_FAIL_PHASE"  # the phase the toy method fails in, where it is served


def register() -> None:
    if os.environ.get(PHASE_VAR):
        from tests.failing_method import register as register_toy_method

        register_toy_method()
