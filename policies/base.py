"""The proposer interface and the typed boundary between proposing and verifying.

A proposer guesses up to ``k`` next tokens for each row of a batch. The engine core
feeds them to the target for verification; the acceptance rule keeps the longest
correct prefix; ``commit`` then tells the proposer how many of its tokens survived so it
can roll its own state back (an integer per row, never a recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingView:
    """What a proposer needs of a row's sampling parameters (temperature 0 = greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ProposalRow:
    """One row to draft for.

    ``token_ids`` are all committed tokens (prompt + output so far); the last one has
    been sampled but not yet run through the target. ``options`` carries the request's
    method-specific settings (e.g. ``max_matching_ngram_size`` for prompt lookup).
    """

    slot: int
    token_ids: Sequence[int]
    num_tokens: int
    sampling: SamplingView = SamplingView()
    generator: torch.Generator | None = None
    options: Mapping[str, object] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # [H] target hidden state that produced the last token


@dataclass(frozen=True)
class Draft:
    """Draft tokens for a batch of rows (linear chains).

    tokens:  [B, K] int64, right-padded with 0 past ``lengths``
    lengths: [B] int64, valid draft tokens per row (0 = no proposal)
    probs:   [B, K, V] float32 or None. The distribution each draft token was sampled
             from; None means deterministic proposals (n-gram), which the rejection
             sampler treats as one-hot — still exact.
    trees:   per row a ``TokenTree`` or None (a chain). For a tree row, tokens[i] are
             its non-root nodes in node order and lengths[i] = tree size - 1.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None
    trees: list | None = None

    @property
    def max_len(self) -> int:
        return int(self.tokens.shape[1])

    @staticmethod
    def empty(batch: int) -> "Draft":
        return Draft(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))

    @staticmethod
    def from_lists(token_lists: Sequence[Sequence[int]]) -> "Draft":
        """A probability-free draft from ragged token lists."""
        k = max((len(t) for t in token_lists), default=0)
        tokens = torch.zeros(len(token_lists), k, dtype=torch.long)
        for i, t in enumerate(token_lists):
            if len(t):
                tokens[i, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
        lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
        return Draft(tokens, lengths)


class Proposer(Protocol):
    """The smallest drafting interface (cf. HF ``CandidateGenerator``).

    Slots are the engine's row ids: a request keeps its slot from admission to finish.
    """

    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        """Draft up to ``row.num_tokens`` tokens for each row."""

    def commit(self, slots: Sequence[int], num_accepted: Sequence[int]) -> None:
        """After verification: ``num_accepted[i]`` of row i's draft were kept."""

    def release(self, slot: int) -> None:
        """The request in ``slot`` finished or was aborted."""


ProposerFactory = Callable[..., Proposer]
_REGISTRY: dict[str, ProposerFactory] = {}


def register_proposer(name: str) -> Callable[[ProposerFactory], ProposerFactory]:
    """Class decorator: make a proposer selectable by ``method=name``."""

    def wrap(factory: ProposerFactory) -> ProposerFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def proposer_factory(name: str) -> ProposerFactory:
    if name not in _REGISTRY:
        raise ValueError(f"unknown speculation method {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def registered_methods() -> list[str]:
    return sorted(_REGISTRY)
