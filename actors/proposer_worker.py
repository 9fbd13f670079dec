"""A method's proposer in an actor of its own (the draft model on its own GPU, the n-gram
pool), and what every worker shares: its device, its thread count, where Ray put it.

The engine worker drives it through a ``RemoteProposer`` proxy (``actors/proposer_proxy.py``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Sequence

import torch

from specray.engine.config import EngineConfig
from specray.engine.drafter_versions import forget_prefixes, weights_module
from specray.engine.kv_blocks import PagingConfig, proposer_paging
from specray.engine.runner import ModelRunner
from specray.engine.gc_pauses import freeze_loaded_heap
from specray.policies.base import CommitRow, Draft, PrefillRow, ProposalRow
from specray.policies.registry import ProposerContext, method_spec

log = logging.getLogger(__name__)


def worker_device() -> str:
    """The GPU Ray gave this actor, or the CPU (fake GPUs in tests, laptops)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def set_worker_threads() -> None:
    # Small models on shared cores: one intra-op thread per worker avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("SPECRAY_WORKER_THREADS", "1")))


def on_this_device(config: EngineConfig) -> EngineConfig:
    """Models load where this worker runs: only the worker sees the GPU Ray gave it (an
    explicit ``device`` is kept: ``--device cpu`` on a GPU machine)."""
    return replace(config, device=worker_device() if config.device == "auto" else config.device)


class Placed:
    """Where Ray put this worker (tests and operations check placement with these)."""

    def gpu_ids(self) -> list:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


QUEUED = frozenset({"prefill", "commit", "release", "load_version"})  # what travels with a propose


class ProposerWorker(Placed):
    """Any method placed ``"worker"`` behind an actor (the draft model, the n-gram pool).

    Seeded sampling: the engine's generator must not be copied here (its copy would replay
    the acceptance test's uniforms), so each slot gets a draft generator of its own,
    seeded from the request's seed.
    """

    def __init__(self, method: str, config: EngineConfig, vocab_size: int, capacity: int,
                 paging: PagingConfig | None = None):
        set_worker_threads()
        config = on_this_device(config)
        spec = method_spec(method)

        def runner_for(model, extra_capacity: int = 0, shift: int = 0, name: str = "draft") -> ModelRunner:
            model = config.load_model(model, role="draft") if isinstance(model, str) else model
            return ModelRunner(model, config.max_num_seqs, capacity + extra_capacity,
                               proposer_paging(paging, config.max_num_seqs, extra_capacity), shift)

        ctx = ProposerContext(vocab_size=vocab_size, max_num_seqs=config.max_num_seqs, capacity=capacity,
                              device=config.device, dtype=config.resolved_dtype, runner_for=runner_for)
        path = config.checkpoint(spec.checkpoint) if spec.checkpoint else None
        self.resource = spec.load(path, ctx) if path else None
        self.proposer = spec.build(replace(ctx, resource=self.resource))
        self._generators: dict[int, torch.Generator] = {}
        self._tokens: dict[int, list[int]] = {}  # each slot's committed tokens (sent as tails)
        freeze_loaded_heap()

    def _rows(self, rows: Sequence[tuple[int, ProposalRow]]) -> list[ProposalRow]:
        """Rows arrive as (offset, row with only the tokens from offset on): rebuild them."""
        full = []
        for offset, r in rows:
            tokens = self._tokens.get(r.slot, [])[:offset] + list(r.token_ids)
            self._tokens[r.slot] = tokens
            full.append(replace(r, token_ids=tokens, generator=self._generator(r)))
        return full

    def apply(self, ops: Sequence[tuple[str, object]]) -> None:
        """What the proxy queued since its last call, in order: ``prefill``, ``commit``,
        ``release`` and ``load_version`` operations (``actors/proposer_proxy.py``)."""
        for op, arg in ops:
            if op not in QUEUED:
                raise ValueError(f"not a queued proposer operation: {op!r}")
            try:
                getattr(self, op)(arg)
            except Exception:  # noqa: BLE001 - one failed operation must not drop the ones after it
                # (each was a call of its own before they were queued: it failed alone); drafts
                # are proposals, so a slot left stale costs acceptance, never output.
                log.exception("proposer %s failed", op)

    def propose(self, ops: Sequence[tuple[str, object]], rows: Sequence[tuple[int, ProposalRow]]) -> Draft:
        self.apply(ops)
        return self.proposer.propose(self._rows(rows))

    def propose_ahead(self, ops: Sequence[tuple[str, object]], rows: Sequence[tuple[int, ProposalRow]],
                      drafts: Draft) -> dict:
        """Overlapped drafting (see ``DraftModelProposer.propose_ahead``); {} if not supported."""
        self.apply(ops)
        if not hasattr(self.proposer, "propose_ahead"):
            return {}
        return self.proposer.propose_ahead(self._rows(rows), drafts)

    def _generator(self, row: ProposalRow) -> torch.Generator | None:
        if row.seed is None or row.sampling.greedy:
            return None
        if row.slot not in self._generators:
            # A different stream from the engine's (seed) for the same request.
            self._generators[row.slot] = torch.Generator().manual_seed((int(row.seed) * 1_000_003 + 12345) % 2**63)
        return self._generators[row.slot]

    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        if hasattr(self.proposer, "prefill"):
            self.proposer.prefill(rows)

    def commit(self, rows: Sequence[CommitRow]) -> None:
        self.proposer.commit(rows)

    def load_version(self, state: dict) -> None:
        """A drafter version (online learning): its weights copied into the serving tensors in
        place, and every slot's state rebuilt from its committed tokens at its next draft
        (``engine/drafter_versions.py``)."""
        with torch.no_grad():
            weights_module(self.resource).load_state_dict(state)
        forget_prefixes(self.resource, self.proposer)
        for s in list(self._tokens):
            self.proposer.release(s)

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.proposer.release(s)
            self._generators.pop(s, None)
            self._tokens.pop(s, None)
