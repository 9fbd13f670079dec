"""A depth-bounded suffix trie with occurrence counts and implicit single-occurrence tails,
the data structure of suffix decoding (``policies/suffix.py``).

What it stores: for every inserted sequence and every start position j, the path
``seq[j], seq[j + 1], ...`` (at most ``max_depth`` tokens); node s counts the occurrences of
the string s (``count``), so the children of s are the tokens that followed s, each with
the number of times it did — the frequencies suffix decoding drafts from (Arctic
Inference's SuffixTree, Oliaro et al. 2024).

Why this structure, in Python:

* **Counts are what is drafted from**, so a suffix automaton (linear size, O(1) matching)
  would have to keep endpos sizes current along its suffix-link chain on every insertion,
  and cannot remove a sequence (the global tree evicts). A trie keeps counts with one
  increment per (token, open suffix) and removes a sequence by decrementing its paths.
* **Memory stays linear in practice** without Arctic's full path compression (hundreds of
  lines of C++ for the sibling/group lists and node splitting): a plain trie of depth D
  holds up to D nodes per token, nearly all of them on paths that occurred once. Here a
  path that occurred once is one *tail* node that points into its sequence (``seq``,
  ``end``): the tokens below it are implicit, and become explicit nodes only when a second
  occurrence reaches them (``_materialize``). Explicit nodes are then the repeated strings,
  plus one tail per occurrence.
* **Insertion is O(open suffixes) per token**: the occurrences of a growing sequence that
  sit at explicit nodes (``_active``; at most D, in practice about the length of the
  longest repeat ending there) each take one child look-up; an occurrence inside its own
  tail costs nothing. On non-repetitive text that is a few dict look-ups per token.
* **Look-up is incremental**: a ``Cursor`` is a position in the tree (an explicit node, or
  ``off`` tokens into a tail), and ``advance`` moves it one token in O(1); a request keeps
  the cursors of its matching suffixes and advances them with its new tokens
  (``SuffixMatcher``), rebuilding only when the tree changed (``version``).

Drafting from a cursor (``draft``) is Arctic's: the continuation probability of a child is
count(child) / count(parent) along the path; ``tree=True`` expands the most probable
continuation paths best-first (a priority queue over path probabilities) up to
``max_nodes``, dropping nodes below ``min_prob``; ``tree=False`` follows the most frequent
child only. The draft's score is the sum of its nodes' probabilities: the expected number of
accepted tokens when the probabilities are right.

>>> t = SuffixTree(max_depth=8)
>>> t.extend("a", [1, 2, 3, 1, 2, 4, 1, 2, 3])
>>> c = t.match([5, 1, 2])[-1]          # the longest matching suffix: [1, 2]
>>> t.depth(c), t.count(c)
(2, 3)
>>> d = t.draft(c, max_nodes=4, min_prob=0.1)
>>> d.tokens, d.parents        # after [1, 2]: 3 twice, 4 once; then what followed those
([3, 4, 1, 1], [0, 0, 1, 2])
>>> [round(p, 2) for p in d.probs]
[0.67, 0.33, 0.33, 0.33]
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence


class _Node:
    """A trie node: the string from the root to it occurred ``count`` times.

    Explicit node: ``children`` maps each next token to its node; ``sid`` names its most
    recent occurrence's sequence (where a draft from it came from, for the global tree's LRU).
    Tail (``children`` None): count 1, the single occurrence (of sequence ``sid``) continues
    implicitly at ``seq[end], seq[end + 1], ...``.
    """

    __slots__ = ("count", "children", "seq", "end", "depth", "sid")

    def __init__(self, depth: int, seq: list, end: int, sid: Hashable, count: int = 1, children: dict | None = None):
        self.count, self.children, self.depth = count, children, depth
        self.seq, self.end, self.sid = seq, end, sid


Cursor = tuple  # (node, off): ``off`` tokens below a tail node (0 at any node itself)


@dataclass
class TreeDraft:
    """A draft from one cursor: node i + 1 (token ``tokens[i]``) hangs under ``parents[i]``
    (0 = the draft's root, the row's last token); ``probs`` are path probabilities."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    source: Hashable = None  # the sequence the match came from (the most recent occurrence)

    @property
    def score(self) -> float:
        return sum(self.probs)

    def first(self, n: int) -> "TreeDraft":
        """The first ``n`` nodes (drafting order puts every parent before its children)."""
        if n >= len(self.tokens):
            return self
        return TreeDraft(self.tokens[:n], self.parents[:n], self.probs[:n], self.match_len, self.source)


class SuffixTree:
    """Suffix trie of depth ``max_depth`` over many sequences (see the module doc).

    ``extend(sid, tokens)`` appends to sequence ``sid`` (a new one, or one still open);
    ``close(sid)`` ends it; ``remove(sid)`` takes it out again (the global tree's eviction).
    """

    def __init__(self, max_depth: int = 32):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 2:
            raise ValueError(f"max_depth must be an integer >= 2, got {max_depth!r}")
        self.max_depth = max_depth
        self.root = _Node(0, [], 0, None, count=0, children={})
        self._seqs: dict[Hashable, list[int]] = {}
        self._active: dict[Hashable, list[_Node]] = {}  # open sequences: occurrences at explicit nodes
        self.version = 0  # bumped by every change: cursors from an older version are stale
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, sid: Hashable) -> bool:
        return sid in self._seqs

    def sequence(self, sid: Hashable) -> list[int]:
        return self._seqs[sid]

    def sids(self) -> list[Hashable]:
        return list(self._seqs)

    # -- building ------------------------------------------------------------------------------
    def extend(self, sid: Hashable, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``sid`` (created if new): every suffix of it that is
        at most ``max_depth`` long is counted once more."""
        seq = self._seqs.get(sid)
        if seq is None:
            seq = self._seqs[sid] = []
            self._active[sid] = []
        elif sid not in self._active:
            raise ValueError(f"sequence {sid!r} was closed")
        active, root, limit = self._active[sid], self.root, self.max_depth
        before = len(seq)
        for t in tokens:
            seq.append(t)
            end = len(seq)
            root.count += 1
            moved = []
            for node in [root, *active]:  # the new occurrence starting at t, then the open ones
                kids = node.children
                child = kids.get(t)
                if child is None:  # a new string: a tail holding this occurrence
                    kids[t] = _Node(node.depth + 1, seq, end, sid)
                    continue
                if child.children is None:  # another occurrence's tail: make it explicit
                    self._materialize(child)
                child.count += 1
                child.sid = sid  # (an explicit node's seq/end are never read again)
                if child.depth < limit:
                    moved.append(child)
            active[:] = moved
        self.num_tokens += len(seq) - before
        self.version += 1

    def _materialize(self, tail: _Node) -> None:
        """A second occurrence reached ``tail``: it becomes explicit, and its own occurrence
        moves on into a tail one token deeper (or, if its open sequence has no next token
        yet, stays here as an open occurrence)."""
        tail.children = {}
        seq, end = tail.seq, tail.end
        if tail.depth >= self.max_depth:
            return
        if end < len(seq):
            tail.children[seq[end]] = _Node(tail.depth + 1, seq, end + 1, tail.sid)
        elif tail.sid in self._active:
            self._active[tail.sid].append(tail)

    def close(self, sid: Hashable) -> None:
        """No more tokens for ``sid`` (its open occurrences are dropped)."""
        self._active.pop(sid, None)

    def remove(self, sid: Hashable) -> None:
        """Take sequence ``sid`` out: each of its suffixes counts once less; branches that
        only it reached are dropped."""
        seq = self._seqs.pop(sid)
        self._active.pop(sid, None)
        self.num_tokens -= len(seq)
        limit = self.max_depth
        for j in range(len(seq)):
            node = self.root
            node.count -= 1
            for t in seq[j : j + limit]:
                kids = node.children
                child = kids.get(t) if kids is not None else None
                if child is None:  # inside a tail: nothing explicit below
                    break
                if child.count <= 1:  # only this occurrence: the whole branch goes
                    del kids[t]
                    break
                child.count -= 1
                node = child
        self.version += 1

    # -- looking up ----------------------------------------------------------------------------
    def active(self, sid: Hashable) -> list[Cursor]:
        """Cursors of the open sequence's suffixes that occurred before (explicit nodes)."""
        return [(node, 0) for node in self._active.get(sid, ())]

    def advance(self, cursor: Cursor, token: int) -> Cursor | None:
        """The cursor one token further, or None if that string never occurred."""
        node, off = cursor
        if node.children is not None:
            child = node.children.get(token)
            return None if child is None else (child, 0)
        pos, seq = node.end + off, node.seq
        if node.depth + off < self.max_depth and pos < len(seq) and seq[pos] == token:
            return (node, off + 1)
        return None

    def match(self, context: Sequence[int]) -> list[Cursor]:
        """Cursors of every suffix of ``context`` (at most ``max_depth - 1`` long, so that
        something can follow) found in the tree, shortest first."""
        cursors: list[Cursor] = []
        root, limit = (self.root, 0), self.max_depth - 1
        for t in context[-limit:]:
            cursors = _advance_all(self, cursors, root, t, limit)
        return cursors

    def depth(self, cursor: Cursor) -> int:
        return cursor[0].depth + cursor[1]

    @staticmethod
    def count(cursor: Cursor) -> int:
        node, off = cursor
        return node.count if off == 0 else 1

    def top_prob(self, cursor: Cursor, exclude: int = 0) -> float:
        """The most frequent continuation's probability: no node of a draft from ``cursor`` is
        more probable, so a draft of n nodes scores at most n times this."""
        total = self.count(cursor) - exclude
        if total <= 0:
            return 0.0
        return max((cnt for _, _, cnt in self._children(cursor)), default=0) / total

    def _children(self, cursor: Cursor):
        """(token, cursor, count) of each continuation."""
        node, off = cursor
        if node.children is not None:
            return [(t, (c, 0), c.count) for t, c in node.children.items()]
        pos = node.end + off
        if node.depth + off < self.max_depth and pos < len(node.seq):
            return [(node.seq[pos], (node, off + 1), 1)]
        return []

    def draft(self, cursor: Cursor, max_nodes: int, min_prob: float = 0.0, max_depth: int | None = None,
              tree: bool = True, exclude: int = 0) -> TreeDraft:
        """The most probable continuations of ``cursor`` (see the module doc).

        max_nodes: most draft nodes; max_depth: most levels (None: any); exclude:
        occurrences of the cursor's own string not to count (the request's own tail, which
        has no continuation yet, in its own prompt-and-output tree).
        """
        out = TreeDraft(match_len=self.depth(cursor), source=cursor[0].sid)
        total = self.count(cursor) - exclude
        if total <= 0 or max_nodes <= 0:
            return out
        depth_limit = max_depth if max_depth is not None else self.max_depth
        if not tree:
            return self._path(cursor, total, max_nodes, min_prob, depth_limit, out)
        heap: list = []
        order = 0
        for tok, child, cnt in self._children(cursor):
            p = cnt / total
            if p >= min_prob:
                heap.append((-p, order, tok, child, 0, 1))
                order += 1
        heapq.heapify(heap)
        while heap and len(out.tokens) < max_nodes:
            neg, _, tok, cur, parent, level = heapq.heappop(heap)
            out.tokens.append(tok)
            out.parents.append(parent)
            out.probs.append(-neg)
            if level >= depth_limit:
                continue
            index, total = len(out.tokens), self.count(cur)
            for ctok, child, cnt in self._children(cur):
                p = -neg * (cnt / total)  # never above the parent's (cnt == total gives exactly it)
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, ctok, child, index, level + 1))
                    order += 1
        return out

    def _path(self, cursor: Cursor, total: int, max_nodes: int, min_prob: float, depth_limit: int,
              out: TreeDraft) -> TreeDraft:
        prob = 1.0
        while len(out.tokens) < min(max_nodes, depth_limit):
            kids = self._children(cursor)
            if not kids:
                break
            tok, child, cnt = max(kids, key=lambda k: k[2])
            prob *= cnt / total
            if prob < min_prob:
                break
            out.parents.append(len(out.tokens))
            out.tokens.append(tok)
            out.probs.append(prob)
            cursor, total = child, self.count(child)
        return out


def _advance_all(tree: SuffixTree, cursors: list[Cursor], root: Cursor, token: int, limit: int) -> list[Cursor]:
    """Every cursor (and a new one at the root) one token further; the ones that fall off the
    tree or reach ``limit`` (nothing could follow) are dropped. Shortest first."""
    out = []
    for cur in [root, *cursors]:
        nxt = tree.advance(cur, token)
        if nxt is not None and nxt[0].depth + nxt[1] <= limit:
            out.append(nxt)
    return out


class SuffixMatcher:
    """One request's matching suffixes in a tree it does not write to (the global tree):
    their cursors, advanced by each new token, rebuilt from the request's last tokens when
    the tree changed since (``version``).

    >>> t = SuffixTree(max_depth=8)
    >>> t.extend(0, [1, 2, 3, 4])
    >>> m = SuffixMatcher(t)
    >>> [t.depth(c) for c in m.update([9, 2, 3])]
    [1, 2]
    """

    def __init__(self, tree: SuffixTree):
        self.tree = tree
        self.cursors: list[Cursor] = []
        self._seen = 0
        self._version = -1

    def update(self, tokens: Sequence[int]) -> list[Cursor]:
        """The cursors for ``tokens`` (the request's tokens so far, a growth of the last call's)."""
        tree, limit = self.tree, self.tree.max_depth - 1
        if self._version != tree.version or len(tokens) < self._seen:
            self.cursors = tree.match(tokens)
        else:
            root = (tree.root, 0)
            for t in tokens[self._seen :]:
                self.cursors = _advance_all(tree, self.cursors, root, t, limit)
        self._seen, self._version = len(tokens), tree.version
        return self.cursors
