"""Thread counts: a process that picks its own takes the cores free now; the demo pair's build
keeps one fixed count (its weights and cache key must not depend on the machine's load)."""

from __future__ import annotations

import os

import pytest

from specray.engine.threads import free_threads


@pytest.mark.parametrize("affinity, load, threads", [
    ({0, 1}, 0.1, 2),          # a quiet 2-core machine: both
    ({0, 1}, 1.0, 1),          # one busy neighbour: the other core
    ({0, 1}, 5.0, 1),          # overloaded: still one
    ({0, 1, 2, 3, 4, 5, 6, 7}, 2.6, 5),
    ({3}, 0.0, 1),             # pinned to one core
])
def test_free_threads_are_the_affinity_less_the_load(monkeypatch, affinity, load, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: affinity, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert free_threads() == threads


def test_without_a_load_average_the_cores_are_taken_as_free(monkeypatch):
    def unavailable():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert free_threads() == 3


def test_the_demo_build_runs_one_fixed_thread_whatever_the_load(monkeypatch):
    """One thread: a neighbour costs the build its share of a core, never a stall."""
    import torch

    from specray.demo import DemoRecipe, pair

    seen = []
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(pair, "_build", lambda *a: seen.append(torch.get_num_threads()) or {})
    before = torch.get_num_threads()
    pair.build_demo_pair(None, 0, DemoRecipe(), None)
    assert seen == [DemoRecipe().threads] == [1] and torch.get_num_threads() == before


def test_a_recipe_without_threads_picks_the_free_cores(monkeypatch):
    import torch

    from specray.training import base

    monkeypatch.setattr(base, "free_threads", lambda: 3)
    monkeypatch.setattr(base, "use_data_cache", lambda d: None)
    monkeypatch.setattr(base, "resolve_target", lambda t, tok: ("t", "tok"))
    seen = []
    parser = base.recipe_parser("specray train x", "doc")
    base.add_common_args(parser, steps=1, lr=1.0)
    before = torch.get_num_threads()
    try:
        for argv in (["--out", "o", "--no-eval"], ["--out", "o", "--no-eval", "--threads", "2"]):
            base.run_recipe(argv, parser, "x", lambda a, t, k: seen.append(torch.get_num_threads()) or {}, {})
    finally:
        torch.set_num_threads(before)
    assert seen == [3, 2]
