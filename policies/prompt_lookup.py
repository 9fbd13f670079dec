"""Prompt-lookup (n-gram) proposer, with TensorRT-LLM's semantics.

The draft for a sequence is what followed the most recent earlier occurrence of its
tail: try the tail n-gram of length ``max_matching_ngram_size`` first, then shorter
ones down to 1; propose up to ``prompt_lookup_num_tokens`` tokens that followed the
match (fewer when fewer exist); propose nothing when no n-gram matches.

Each sequence keeps an incremental index (n-gram -> position after its most recent
occurrence), extended with only the tokens added since the last call, so a step costs
O(new tokens), not O(sequence length). Only committed tokens ever enter the index,
so rejected drafts need no rollback.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import Field

from specray.policies.base import CommitRow, Draft, ProposalRow, extends
from specray.policies.registry import LinearOptions, MethodSpec, register_method

def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class NgramIndex:
    """Incremental n-gram index over one growing token sequence.

    ``maps[n - 1]`` maps each n-gram to the position right after its most recent
    occurrence that has a continuation (the n-gram at the very end of the sequence
    is not indexed yet: nothing follows it).

    >>> idx = NgramIndex()
    >>> idx.propose([1, 2, 3, 9, 1, 2], num_tokens=4, max_ngram=2)
    [3, 9, 1, 2]
    >>> idx.propose([1, 2, 3, 9, 1, 2, 5], num_tokens=4, max_ngram=2)
    []
    """

    def __init__(self) -> None:
        self._tokens: list[int] = []
        self._maps: list[dict[tuple[int, ...], int]] = []

    def reset(self) -> None:
        self._tokens = []
        self._maps = []

    def _add_ends(self, maps: list[dict[tuple[int, ...], int]], first: int, last: int, n_from: int) -> None:
        """Index n-grams (n > n_from) ending right before positions first..last-1."""
        tokens = self._tokens
        for end in range(max(first, 1), last):
            for n in range(n_from + 1, min(len(maps), end) + 1):
                maps[n - 1][tuple(tokens[end - n : end])] = end

    def _sync(self, token_ids: Sequence[int], max_ngram: int) -> None:
        if not extends(token_ids, self._tokens):
            self.reset()
        old_len = len(self._tokens)
        self._tokens.extend(token_ids[old_len:])
        new_len = len(self._tokens)
        if max_ngram > len(self._maps):
            # Longer n-grams than indexed so far: index them over the whole history once.
            known = len(self._maps)
            self._maps.extend({} for _ in range(max_ngram - known))
            self._add_ends(self._maps, 1, old_len, n_from=known)
        # An n-gram ending at `end` has a continuation iff end < new_len; ends below
        # old_len were indexed on earlier calls.
        self._add_ends(self._maps, old_len, new_len, n_from=0)

    def propose(self, token_ids: Sequence[int], num_tokens: int, max_ngram: int) -> list[int]:
        """Draft up to ``num_tokens`` tokens continuing ``token_ids``.

        ``token_ids`` must extend the sequence of the previous call; a sequence that
        does not (shorter, or different at a probed position) rebuilds the index.
        """
        _check_positive("prompt_lookup_num_tokens", num_tokens)
        _check_positive("max_matching_ngram_size", max_ngram)
        self._sync(token_ids, max_ngram)
        tokens = self._tokens
        length = len(tokens)
        # The tail n-gram needs an earlier occurrence, hence length > n.
        for n in range(min(max_ngram, length - 1), 0, -1):
            start = self._maps[n - 1].get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start : start + num_tokens]
        return []


class NgramOptions(LinearOptions):
    """Prompt lookup: ``num_speculative_tokens`` is TensorRT-LLM's prompt_lookup_num_tokens."""

    method: Literal["ngram"] = "ngram"
    max_matching_ngram_size: int = Field(2, ge=1, le=16, description="Longest tail n-gram matched first.")


class PromptLookupProposer:
    """Proposer drafting by prompt lookup; ``row.num_tokens`` is prompt_lookup_num_tokens.

    Drafts are deterministic, so ``Draft.probs`` is None (one-hot for the rejection
    sampler). A row with ``num_tokens == 0`` gets no proposal.

    >>> from specray.policies.base import ProposalRow
    >>> prop = PromptLookupProposer(max_matching_ngram_size=2)
    >>> prop.propose([ProposalRow(slot=0, token_ids=[5, 6, 7, 5, 6], num_tokens=4)]).tokens.tolist()
    [[7, 5, 6]]
    """

    def __init__(self, max_matching_ngram_size: int = 2, **_ignored: object) -> None:
        _check_positive("max_matching_ngram_size", max_matching_ngram_size)
        self.max_matching_ngram_size = max_matching_ngram_size
        self._indices: dict[int, NgramIndex] = {}

    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        drafts: list[list[int]] = []
        for row in rows:
            if row.num_tokens < 0:
                raise ValueError(f"num_tokens must be >= 0, got {row.num_tokens} for slot {row.slot}")
            index = self._indices.setdefault(row.slot, NgramIndex())
            if row.num_tokens == 0:
                drafts.append([])
                continue
            max_ngram = row.option("max_matching_ngram_size", self.max_matching_ngram_size)
            drafts.append(index.propose(row.token_ids, row.num_tokens, max_ngram))
        return Draft.from_lists(drafts)

    def commit(self, rows: Sequence[CommitRow]) -> None:
        """Nothing to roll back: the index holds committed tokens only."""

    def release(self, slot: int) -> None:
        self._indices.pop(slot, None)


register_method(MethodSpec(
    name="ngram",
    options=NgramOptions,
    build=lambda ctx: PromptLookupProposer(),
    placement="worker",
    requirement="nothing (always available)",
))
