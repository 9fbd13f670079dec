"""Model and proposer workers. Each is a plain class; ``ray.remote`` is applied by the
coordinator with the placement options of its role (so they are testable without Ray).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Sequence

import torch

from specray.engine.config import EngineConfig
from specray.engine.engine import LLMEngine, eos_ids
from specray.engine.runner import ModelRunner
from specray.engine.verify import TargetScores
from specray.policies.base import Draft, ProposalRow, proposer_factory

log = logging.getLogger(__name__)


def worker_device() -> str:
    """The GPU Ray gave this actor, or the CPU (fake GPUs in tests, laptops)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _threads() -> None:
    # Small models on shared cores: one intra-op thread per worker avoids oversubscription.
    torch.set_num_threads(int(os.environ.get("SPECRAY_WORKER_THREADS", "1")))


def _on_this_device(config: EngineConfig) -> EngineConfig:
    """Models load where this worker runs: only the worker sees the GPU Ray gave it."""
    return replace(config, device=worker_device())

class _Placed:
    """Where Ray put this worker (tests and operations check placement with these)."""

    def gpu_ids(self) -> list:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

class TargetWorker(_Placed):
    """The target model's runner and KV cache (and Medusa heads, which read its hidden states)."""

    def __init__(self, config: EngineConfig):
        _threads()
        config = _on_this_device(config)
        model = config.load_model(config.target)
        self.runner = ModelRunner(model, config.max_num_seqs, config.context_length(model.config))
        self.eos = eos_ids(model, None)
        self.medusa = None
        if config.medusa is not None:
            from specray.policies.medusa import MedusaHeads, MedusaProposer

            heads = MedusaHeads.load(config.medusa, hidden_size=model.config.hidden_size).to(self.runner.device)
            self.medusa = MedusaProposer(heads)

    def limits(self) -> dict:
        return {
            "capacity": self.runner.capacity,
            "vocab_size": self.runner.vocab_size,
            "eos_ids": sorted(self.eos),
            "medusa_heads": self.medusa.heads.num_heads if self.medusa else 0,
        }

    def forward(self, slots, tokens, logits_at=None, tree=None, want_hidden=False, sampled=()):
        """(TargetScores over [B, m] — full logits only for the ``sampled`` rows —, hidden
        [B, m, H] or None), on the CPU: what crosses the wire stays small for greedy rows."""
        out = self.runner.forward(slots, tokens, logits_at, tree=tree)
        return TargetScores.from_logits(out.logits, sampled).cpu(), (out.hidden.cpu() if want_hidden else None)

    def prefill(self, slots, prompts, want_hidden=False, sampled=()):
        """Scores [B, 1] at each prompt's last token (and hidden [B, H])."""
        for s in slots:
            self.runner.reset(s)
        out = self.runner.forward(slots, prompts)
        hidden = out.hidden[:, 0].cpu() if want_hidden else None
        return TargetScores.from_logits(out.logits, sampled).cpu(), hidden

    def compact(self, paths: Sequence[tuple[int, list[int]]]) -> None:
        self.runner.compact(*zip(*paths))

    # The proposer protocol, for Medusa rows (the heads live here, next to the target).
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        if self.medusa is None:
            raise ValueError("this target worker has no Medusa heads")
        return self.medusa.propose(rows)

    def commit(self, slots, num_accepted) -> None:
        pass

    def release(self, slots) -> None:
        pass

    def set_lengths(self, pairs: Sequence[tuple[int, int]]) -> None:
        for slot, length in pairs:
            self.runner.set_length(slot, length)

    def reset(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.runner.reset(s)

class ProposerWorker(_Placed):
    """Any registered proposer behind an actor (the draft model, the n-gram pool).

    Seeded sampling: the coordinator's generator must not be copied here (its copy
    would replay the acceptance test's uniforms), so each slot gets a draft generator
    of its own, seeded from the request's seed.
    """

    def __init__(self, method: str, config: EngineConfig | None = None, vocab_size: int | None = None):
        _threads()
        resources: dict = {"vocab_size": vocab_size}
        if config is not None and config.draft:
            config = _on_this_device(config)
            model = config.load_model(config.draft)
            capacity = config.context_length(model.config)
            resources["draft_runner"] = ModelRunner(model, config.max_num_seqs, capacity)
        self.proposer = proposer_factory(method)(**resources)
        self._generators: dict[int, torch.Generator] = {}

    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        rows = [replace(r, generator=self._generator(r)) for r in rows]
        return self.proposer.propose(rows)

    def _generator(self, row: ProposalRow) -> torch.Generator | None:
        seed = row.options.get("seed")
        if seed is None:
            return None
        if row.slot not in self._generators:
            # A different stream from the coordinator's (seed) for the same request.
            self._generators[row.slot] = torch.Generator().manual_seed((int(seed) * 1_000_003 + 12345) % 2**63)
        return self._generators[row.slot]

    def commit(self, slots: Sequence[int], num_accepted: Sequence[int]) -> None:
        self.proposer.commit(slots, num_accepted)

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.proposer.release(s)
            self._generators.pop(s, None)

class EngineWorker(_Placed):
    """Colocated mode: target and draft in one actor on one device (no hop per step)."""

    def __init__(self, config: EngineConfig):
        _threads()
        self.engine = LLMEngine(_on_this_device(config))

    def limits(self) -> dict:
        e = self.engine
        return {"capacity": e.capacity, "vocab_size": e.target.vocab_size, "eos_ids": sorted(e.limits.eos_ids),
                "medusa_heads": e.limits.medusa_heads}

    def add(self, request) -> None:
        self.engine.scheduler.add(request)

    def abort(self, request_id: str):
        return self.engine.abort(request_id)

    def step(self):
        return self.engine.step()
