"""A toy speculation method that raises for one poisoned request (failure-containment tests).

Its proposer guesses that the last token repeats, and raises in one phase of a step (its
prefill hook, its proposal, the target's verification of its draft — it drafts a token the
vocabulary lacks — or its commit hook) for the requests whose prompt starts with ``POISON``.
Built for the phase ``BY_PROMPT``, the token after ``POISON`` names the phase
(``poisoned(phase)``): one server or coordinator then serves every phase's failure, and the
tests that share it see whether it goes on serving them.

In-process tests register it with ``register_method``. Behind Ray, the test session's
``worker_process_setup_hook`` (``tests/worker_hook.py``, calling ``register``) registers it in
the processes whose runtime environment names the phase (``runtime_env``): a coordinator and
every worker it starts, or Serve replicas (``ServeConfig.runtime_env``) and theirs.
"""

from __future__ import annotations

import os
from typing import Literal

from specray.policies.base import Draft, DraftRow
from specray.policies.registry import LinearOptions, MethodSpec, register_method
from tests.worker_hook import PHASE_VAR

POISON = [63, 63, 63, 63]  # the prompt that starts so is the one that fails
PHASES = ("prefill", "propose", "verify", "commit")
BY_PROMPT = "by-prompt"
VOCAB = 64
NAME = "toy_fail"


class FailOptions(LinearOptions):
    """Guess that the last token repeats; raise for poisoned requests in one phase."""

    method: Literal["toy_fail"] = "toy_fail"


def poisoned(phase: str) -> list[int]:
    """A prompt that fails in ``phase`` (any phase where the proposer was built for one)."""
    return POISON + [PHASES.index(phase), 1, 2]


class FailingProposer:
    def __init__(self, phase: str):
        self.phase, self.poisoned = phase, {}  # slot -> the phase it fails in

    def prefill(self, rows):
        for row in rows:
            if list(row.token_ids[: len(POISON)]) == POISON:
                phase = PHASES[row.token_ids[len(POISON)]] if self.phase == BY_PROMPT else self.phase
                self.poisoned[row.slot] = phase
                if phase == "prefill":
                    raise ValueError("poisoned prompt in prefill")

    def propose(self, rows):
        drafts = []
        for row in rows:
            phase = self.poisoned.get(row.slot)
            if phase == "propose":
                raise ValueError("poisoned row in propose")
            token = VOCAB + 5 if phase == "verify" else row.token_ids[-1]  # no such token
            drafts.append(DraftRow([token] * row.num_tokens))
        return Draft(drafts)

    def commit(self, rows):
        if any(self.poisoned.get(row.slot) == "commit" for row in rows):
            raise ValueError("poisoned row in commit")

    def release(self, slot):
        self.poisoned.pop(slot, None)


def spec(phase, placement: Literal["worker", "target"] = "target") -> MethodSpec:
    """The method's spec; ``phase()`` names the phase its proposers fail in when built."""
    return MethodSpec(NAME, FailOptions, build=lambda ctx: FailingProposer(phase()), placement=placement)


def register() -> None:
    """Called by the test session's Ray ``worker_process_setup_hook`` (``tests/worker_hook.py``): in
    the processes started with ``runtime_env(phase)`` (a coordinator or Serve replicas and the
    workers they start), the method, placed in a worker of its own in the separate layout
    (so that its failures cross the proxy); elsewhere nothing."""
    if os.environ.get(PHASE_VAR):
        register_method(spec(lambda: os.environ[PHASE_VAR], placement="worker"))


def runtime_env(phase: str = BY_PROMPT) -> dict:
    """The runtime environment of an actor (and its workers) that serves the method."""
    return {"env_vars": {PHASE_VAR: phase}}
