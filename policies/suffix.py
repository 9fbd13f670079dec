"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Arctic Inference's suffix decoding
in vLLM and SGLang): draft from suffix trees of what was already written, no draft model.

Two trees are searched for the row's last tokens (``policies/suffix_tree.py``):

* the request's own tree, over its prompt and output, built as tokens are committed;
* the global tree, over finished requests' outputs — bounded, least recently used out
  (``policies/suffix_cache.py``). In one process it is an object (engines that share it share
  the tree); in a Ray deployment each engine replica keeps a replica of one shared tree and
  syncs it in batches with a tree actor (``actors/suffix_cache.py``), off the step's path.

Each suffix of the row's tail that occurred in a tree is a candidate match of length m. A
match may draft up to ``min(num_speculative_tokens, max_spec_factor * m + max_spec_offset)``
tokens (Arctic's ``max_spec_factor``: a longer match earns a longer draft); from the match,
the most frequent continuations are expanded best-first by their estimated probability
(counts along the path; nodes below ``min_token_prob`` are dropped), as a tree of paths
(``tree: false``: one path). The candidate whose draft has the highest score — the sum of its
nodes' probabilities, the expected number of accepted tokens — is proposed; ties go to the
longer match, as in Arctic. In the request's own tree its own last occurrence (the tail
itself, which has no continuation yet) is not counted, so probabilities are over earlier
occurrences only (Arctic counts it, which halves the first probability of every draft from a
string seen once before).

Drafts are deterministic functions of the committed tokens (one-hot q), verified under the
tree mask by the tree acceptance rule: greedy output is the target's and sampled output has
the target's distribution exactly.

Rows sharing a step share a budget of draft tokens (``batch_draft_tokens``), given to the
most probable nodes over all rows (a node never outranks its parent), because on hardware
where every verified token costs compute — CPUs, and GPUs at large batches — a batch of long
drafts costs more than it returns. The self-tuning speculation length
(``policies/controller.py``) switches requests that leave the options to the engine on and
off by measured acceptance and step cost, as for the other tree methods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from pydantic import Field

from specray.kernels.tree import TokenTree
from specray.policies.base import CommitRow, Draft, DraftRow, PrefillRow, ProposalRow, extends
from specray.policies.registry import Limits, MethodOptions, MethodSpec, register_method
from specray.policies.suffix_cache import GlobalSuffixCache
from specray.policies.suffix_tree import SuffixMatcher, SuffixTree, TreeDraft

# Draft tokens per step summed over the step's suffix rows (two or more) before the least
# probable nodes are dropped; a row alone in its step keeps its whole draft.
BATCH_DRAFT_TOKENS = 64
# Outputs shorter than this are not worth a place in the global tree.
MIN_CACHED_OUTPUT = 2


class SuffixOptions(MethodOptions):
    """Suffix decoding, per request (Arctic Inference's / vLLM's names and defaults).

    The trees' depth and the global tree's size (0: no global tree) are the engine's
    (``SuffixCacheConfig``).
    """

    method: Literal["suffix"] = "suffix"
    num_speculative_tokens: int = Field(16, ge=1, le=256, description="Most draft tokens per step, the whole tree "
                                        "(vLLM's num_speculative_tokens, Arctic's max_spec_tokens).")
    max_spec_factor: float = Field(1.0, ge=0, le=64, description="A match of m tokens drafts at most "
                                   "max_spec_factor * m + max_spec_offset tokens.")
    max_spec_offset: float = Field(0.0, ge=-64, le=64, description="See max_spec_factor.")
    min_token_prob: float = Field(0.1, ge=0, le=1, description="Draft only tokens whose estimated probability "
                                  "(frequency along the path) is at least this.")
    tree: bool = Field(True, description="Draft the most frequent continuation paths as a tree (false: one path).")


@dataclass
class _Row:
    """One request's state: its own tree (prompt + output), its matches in the global tree
    and its output as committed (every step's, drafting or not: the output at release)."""

    options: SuffixOptions
    own: SuffixTree
    matcher: SuffixMatcher | None
    output: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.own.sequence(0)


class SuffixProposer:
    """Suffix-tree drafts (see the module doc). ``cache``: the global tree (shared, or this
    proposer's own); ``batch_draft_tokens``: the per-step budget over rows (None: none).

    >>> prop = SuffixProposer()
    >>> row = ProposalRow(slot=0, token_ids=[7, 1, 2, 3, 4, 9, 1, 2], num_tokens=8)
    >>> prop.propose([row]).rows[0].tokens          # after [1, 2] came [3, 4, 9, ...]
    [3, 4]
    """

    def __init__(self, cache: GlobalSuffixCache | None = None, batch_draft_tokens: int | None = BATCH_DRAFT_TOKENS,
                 **_ignored: object):
        self.cache = cache if cache is not None else GlobalSuffixCache()
        self.batch_draft_tokens = batch_draft_tokens
        self._rows: dict[int, _Row] = {}

    @property
    def max_tree_depth(self) -> int:
        return self.cache.max_tree_depth

    # -- propose ---------------------------------------------------------------------------
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        self.cache.poll()  # the global tree's inserts and syncs, bounded per step
        drafts = [self._propose_row(r) for r in rows]
        if self.batch_draft_tokens is not None and len(rows) > 1:
            drafts = _within_budget(drafts, self.batch_draft_tokens)
        out = []
        for d in drafts:
            chain = d.parents == list(range(len(d.parents)))  # one path: the batched chain path takes it
            out.append(DraftRow(d.tokens, None if chain else TokenTree.from_parents(d.parents)))
        return Draft(out)

    def _propose_row(self, r: ProposalRow) -> TreeDraft:
        if r.num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {r.num_tokens} for slot {r.slot}")
        state = self._sync(r)
        o = state.options
        width = r.width if r.width is not None else o.num_speculative_tokens
        most = min(o.num_speculative_tokens, width)
        if r.num_tokens == 0 or most <= 0:
            return TreeDraft()
        # Candidates: (cursor, tree, occurrences not to count); every suffix of the row's tail
        # that occurred before, in its own tree and in the global one.
        candidates = [(c, state.own, 1) for c in state.own.active(0)]
        if state.matcher is not None:
            candidates += [(c, self.cache.tree, 0) for c in state.matcher.update(state.tokens)]
        best, best_key, best_tree = TreeDraft(), (0.0, 0), None
        ranked = sorted(((min(most, _spec_limit(o, tree.depth(c))), tree.depth(c), i)
                         for i, (c, tree, _) in enumerate(candidates)), reverse=True)
        for limit, m, i in ranked:
            if limit <= best_key[0]:  # its draft cannot score more than its token limit
                break
            cursor, tree, exclude = candidates[i]
            d = tree.draft(cursor, limit, o.min_token_prob, r.num_tokens, o.tree, exclude)
            key = (d.score, m)
            if key > best_key:
                best, best_key, best_tree = d, key, tree
        if best_tree is self.cache.tree:
            self.cache.touch(best.source)
        return best

    def _sync(self, r: ProposalRow) -> _Row:
        """The row's state, with the tokens committed since the last step added to its tree."""
        o = r.options if isinstance(r.options, SuffixOptions) else SuffixOptions()
        state = self._rows.get(r.slot)
        if state is None or not extends(r.token_ids, state.tokens):
            state = self._start(r.slot, r.token_ids[:-1], o)  # the root is new; the rest was the prompt
        state.options = o
        seen = len(state.tokens)
        if len(r.token_ids) > seen:
            state.own.extend(0, r.token_ids[seen:])
        return state

    def _start(self, slot: int, prompt: Sequence[int], o: SuffixOptions) -> _Row:
        own = SuffixTree(self.max_tree_depth)
        own.extend(0, prompt)
        state = _Row(o, own, SuffixMatcher(self.cache.tree) if self.cache.enabled else None)
        self._rows[slot] = state
        return state

    # -- prefill / commit / release --------------------------------------------------------
    def prefill(self, rows: Sequence[PrefillRow]) -> None:
        """A request entered: its prompt goes into its own tree now (the prefill step), not
        in its first drafting step."""
        for row in rows:
            self._start(row.slot, row.token_ids, SuffixOptions()).output.append(row.first_token)

    def commit(self, rows: Sequence[CommitRow]) -> None:
        """Record the emitted tokens (a step's tokens reach ``propose`` only at the row's next
        drafting step, and the last step's never). A step that ends at a stop token may have
        emitted a few tokens past it; they are kept here too (text the target wrote)."""
        for c in rows:
            state = self._rows.get(c.slot)
            if state is not None:
                state.output += c.tokens

    def release(self, slot: int) -> None:
        """The request is gone: its output goes to the global tree."""
        state = self._rows.pop(slot, None)
        if state is not None and self.cache.enabled and len(state.output) >= MIN_CACHED_OUTPUT:
            self.cache.add(state.output)
            self.cache.poll()  # a replica may be due to send its outputs


def _spec_limit(o: SuffixOptions, match_len: int) -> int:
    """Arctic's bound on the draft of a match of ``match_len`` tokens."""
    return max(0, int(match_len * o.max_spec_factor + o.max_spec_offset + 1e-6))


def _within_budget(drafts: list[TreeDraft], budget: int) -> list[TreeDraft]:
    """The ``budget`` most probable nodes over all rows (a parent has at least its child's
    probability and is shallower, so ranking by (-prob, depth) keeps every kept node's path)."""
    total = sum(len(d.tokens) for d in drafts)
    if total <= budget:
        return drafts
    ranked = []
    for i, d in enumerate(drafts):
        depth = [0]
        for node, (p, parent) in enumerate(zip(d.probs, d.parents), start=1):
            depth.append(depth[parent] + 1)
            ranked.append((-p, depth[node], i, node))
    ranked.sort()
    keep = [set() for _ in drafts]
    for _, _, i, node in ranked[:budget]:
        keep[i].add(node)
    out = []
    for d, kept in zip(drafts, keep):
        index = {0: 0}
        cut = TreeDraft(match_len=d.match_len, source=d.source)
        for node in range(1, len(d.tokens) + 1):
            if node in kept:
                cut.tokens.append(d.tokens[node - 1])
                cut.parents.append(index[d.parents[node - 1]])
                cut.probs.append(d.probs[node - 1])
                index[node] = len(cut.tokens)
        out.append(cut)
    return out


def _check(options: SuffixOptions, facts: Mapping, limits: Limits) -> None:
    if options.num_speculative_tokens >= limits.capacity:
        raise ValueError(f"suffix num_speculative_tokens {options.num_speculative_tokens} does not fit the "
                         f"{limits.capacity}-token context")
    if options.max_spec_factor == 0 and options.max_spec_offset < 1:
        raise ValueError("suffix max_spec_factor 0 with max_spec_offset < 1 never drafts a token: raise one of them")


register_method(MethodSpec(
    name="suffix",
    options=SuffixOptions,
    build=lambda ctx: SuffixProposer(ctx.resource),
    drafts_trees=True,
    placement="target",
    requirement="nothing (always available)",
    check=_check,
))
