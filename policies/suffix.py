"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding"; Arctic Inference's suffix decoding
in vLLM and SGLang): draft from suffix trees of what was already written, no draft model.

Two trees are searched for the row's last tokens (``policies/suffix_tree.py``):

* the request's own tree, over its prompt and output, built as tokens are committed;
* the global tree, over finished requests' outputs — bounded, least recently used out
  (``policies/suffix_cache.py``). In one process it is an object (engines that share it share
  the tree); in a Ray deployment each engine replica keeps a replica of one shared tree and
  syncs it in batches with a tree actor (``actors/suffix_cache.py``), off the step's path.
  Each output is cached with the prompt tokens right before it (at most the tree depth), the
  context it was written in: a re-asked prompt then finds its earlier answer from its first
  step. (Arctic caches the response alone; a match must then grow from the new answer's own
  first tokens, and with ``max_spec_factor`` 1 the drafts ramp up 1, 2, 4, 8, ... tokens.)

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

How much of each draft is verified is chosen per step (``best_width``): a step verifies every
row as wide as its widest (rows are padded to it), so the rows of a step are cut to one width
W, each keeping its W most probable nodes, with W maximising the step's expected tokens (B
rows' own tokens plus the kept nodes' probabilities) per unit of step cost (1 + B * W /
``step_cost_tokens``: the step's cost doubles with that many more verified tokens). Where
verifying is dear — CPUs, GPUs at large batches — and the guesses unsure, W shrinks, to 0 when
no draft is worth its cost; a lone row of sure guesses drafts all it has. On top of that the
verification budget (``policies/budget.py``) cuts requests that leave the options to the
engine to the nodes worth their cost, as for the other tree methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from pydantic import Field

from specray.kernels.tree import TokenTree
from specray.policies.base import CommitRow, Draft, DraftRow, PrefillRow, ProposalRow, extends
from specray.policies.registry import Limits, MethodOptions, MethodSpec, register_method
from specray.policies.suffix_cache import GlobalSuffixCache
from specray.policies.suffix_tree import SuffixMatcher, SuffixTree, TreeDraft

# Verified tokens per step that double the step's cost, in the width rule (``best_width``): a
# CPU-like figure (the demo pair on these CPUs: +16 tokens at batch 1 costs +38%, +128 at
# batch 8 +115%); a GPU at small batches verifies far more for free.
STEP_COST_TOKENS = 64
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
    context: list[int]  # the prompt's last tokens (at most the tree depth), cached with the output
    output: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.own.sequence(0)


class SuffixProposer:
    """Suffix-tree drafts (see the module doc). ``cache``: the global tree (shared, or this
    proposer's own); ``step_cost_tokens``: the width rule's cost scale (None: every row's
    whole draft is verified).

    >>> prop = SuffixProposer()
    >>> row = ProposalRow(slot=0, token_ids=[7, 1, 2, 3, 4, 9, 1, 2], num_tokens=8)
    >>> prop.propose([row]).rows[0].tokens          # after [1, 2] came [3, 4, 9, ...]
    [3, 4]
    """

    def __init__(self, cache: GlobalSuffixCache | None = None, step_cost_tokens: float | None = STEP_COST_TOKENS,
                 **_ignored: object):
        self.cache = cache if cache is not None else GlobalSuffixCache()
        self.step_cost_tokens = step_cost_tokens
        self._rows: dict[int, _Row] = {}

    @property
    def max_tree_depth(self) -> int:
        return self.cache.max_tree_depth

    # -- propose ---------------------------------------------------------------------------
    def propose(self, rows: Sequence[ProposalRow]) -> Draft:
        self.cache.poll()  # the global tree's inserts and syncs, bounded per step
        drafts = [self._propose_row(r) for r in rows]
        if self.step_cost_tokens is not None:
            width = best_width([d.probs for d in drafts], self.step_cost_tokens)
            drafts = [d.first(width) for d in drafts]
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
        ranked = []  # (the most its draft can score, match length, its token limit, index)
        for i, (c, tree, exclude) in enumerate(candidates):
            m = tree.depth(c)
            limit = min(most, _spec_limit(o, m))
            levels = min(tree.max_depth - m, r.num_tokens)  # the tree holds max_depth - m tokens after m
            if not o.tree:
                limit = min(limit, levels)
            if limit > 0 and levels > 0:
                # No node is likelier than the likeliest continuation, and the probabilities of
                # one level's nodes sum to at most 1: a bound on the draft's score.
                ranked.append((min(limit * tree.top_prob(c, exclude), levels), m, limit, i))
        ranked.sort(reverse=True)
        for bound, m, limit, i in ranked:
            if bound <= best_key[0]:  # no draft from here can score more
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
        state = _Row(o, own, SuffixMatcher(self.cache.tree) if self.cache.enabled else None,
                     list(prompt[-self.max_tree_depth :]))
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
            self.cache.add(state.context + state.output)
            self.cache.poll()  # a replica may be due to send its outputs


def _spec_limit(o: SuffixOptions, match_len: int) -> int:
    """Arctic's bound on the draft of a match of ``match_len`` tokens."""
    return max(0, int(match_len * o.max_spec_factor + o.max_spec_offset + 1e-6))


def best_width(probs: Sequence[Sequence[float]], step_cost_tokens: float) -> int:
    """The width W that maximises (B + sum over rows of their first W nodes' probabilities) /
    (1 + B * W / step_cost_tokens); each row's probabilities in drafting order (best first).

    >>> best_width([[1.0] * 8], 64), best_width([[0.1]] * 8, 64), best_width([[0.9, 0.6, 0.3, 0.1]] * 8, 64)
    (8, 0, 3)
    """
    batch = len(probs)
    if batch == 0:
        return 0
    widest = max(map(len, probs))
    gains = [0.0] * (widest + 1)  # gains[w]: the w-th nodes' probabilities, summed over rows
    for row in probs:
        for w, p in enumerate(row, start=1):
            gains[w] += p
    best, best_value, expected = 0, 1.0, float(batch)
    for w in range(1, widest + 1):
        expected += gains[w]
        value = expected / (batch * (1 + batch * w / step_cost_tokens))
        if value > best_value:
            best, best_value = w, value
    return best


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
