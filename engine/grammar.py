"""Structured outputs: each constrained request's grammar, and the masks that keep every
position a step scores inside it — each from the grammar state of its own path.

The backend is llguidance (``docs/structured-outputs.md`` says why): a Rust library with no
Python dependencies, whose matcher consumes a token, rolls back, and fills a token bitmask
for its current state. A request's constraint (``StructuredOutputs``) becomes a grammar
string where the request enters (``Grammars.source``: checked against the tokenizer, cached),
and a matcher where its steps run (``Grammars.matcher``: the engine attaches it when the
request joins; a request resumed on another worker replays its tokens into a new one).

Speculation stays exact because the target's logits are masked at every scored node with
the matcher state after that node's path (``allowed_masks``, the batch's masks at once): a
tree gets one mask per node, never one for the whole tree; a node whose own token the grammar
refuses is never accepted (the masked target gives it no mass), so what is below it is left
unmasked. Only the tokens a step keeps advance the matcher (``RowGrammar.advance``).

The grammar is also a drafter (``forced_drafts``): where every continuation the grammar allows
starts with the same bytes (a schema's keys, quotes and punctuation, the rest of a ``choice``
after its first distinct token), those bytes tokenised as the tokenizer writes them are a
deterministic draft, verified like any other (``docs/structured-outputs.md``, "The grammar
as a drafter").

The grammar's end is the request's end: where the grammar may end, the request's stop
tokens are allowed (the tokenizer's EOS stands for them in the matcher); where it must, only
they are. A request without stop tokens (``ignore_eos``) finishes with 'stop' where the
grammar is complete.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
from typing import Sequence

import numpy as np
import torch

from specray.policies.base import DraftRow

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as ``json.dumps`` writes it: one space after ``,`` and ``:``, no other whitespace.
A grammar that allows any whitespace lets a model (or a draft) emit it without end."""

ANY_OBJECT = {"type": "object"}
CACHED_GRAMMARS = 256  # checked grammars kept per tokenizer
FORCED_MAX = 16
"""Most forced tokens a row drafts in one step: a JSON key with its quotes and separators is a
handful of tokens; a longer forced literal is drafted over several steps rather than widening
a padded verification for every row of the batch at once."""


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the message says why (HTTP 400)."""


def source(kind: str, value) -> str:
    """The llguidance grammar of one constraint kind (not yet checked against a tokenizer)."""
    import llguidance

    make = llguidance.LLMatcher
    if kind == "json":
        schema = value if isinstance(value, str) else json.dumps(value)
        try:
            return make.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from None
    if kind == "json_object":
        return make.grammar_from_json_schema(json.dumps(ANY_OBJECT), defaults=JSON_DEFAULTS)
    if kind == "regex":
        return make.grammar_from_regex(value)
    if kind == "choice":
        return make.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        text = value
        if "::=" in text:  # GBNF / EBNF (llama.cpp's, xgrammar's) rather than Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as exc:  # noqa: BLE001 - its parser's errors are the user's
                raise GrammarError(f"invalid grammar: {exc}") from None
        return make.grammar_from_lark(text)
    if kind == "structural_tag":
        return _structural_tag(value)
    raise GrammarError(f"unsupported structured output kind {kind!r}")


def _structural_tag(value) -> str:
    """vLLM's structural tag: free text in which each ``begin`` (starting with one of the
    ``triggers``) opens a segment that follows its JSON ``schema`` up to ``end``."""
    import llguidance

    try:
        tag = json.loads(value) if isinstance(value, str) else value
        structures, triggers = tag["structures"], tag["triggers"]
        tags = []
        for s in structures:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise GrammarError(f"structural tag: begin {s['begin']!r} starts with none of the triggers {triggers}")
            tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema") or {},
                                             end=s.get("end", "")))
    except GrammarError:
        raise
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise GrammarError(f"invalid structural tag (structures of begin, schema, end; triggers): {exc!r}") from None
    return llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags, assume_special=False))


def one_line(message: str) -> str:
    """llguidance's error without its source excerpt (the lines that quote and point)."""
    kept = [ln.strip() for ln in message.splitlines()
            if ln.strip() and not set(ln.strip()) <= set("^ ") and not ln.strip()[0].isdigit()]
    return " ".join(kept)[:500]


class Grammars:
    """One tokenizer's grammars: checked sources (cached by constraint) and matchers.

    vocab_size: the width of the target's logits (a tokenizer may have fewer tokens: the
    rest are never allowed); eos_id: the token that stands for "the grammar may end here"
    in llguidance's masks (the tokenizer's EOS; without one, an id past the logits')."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int | None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_id = eos_id if eos_id is not None else vocab_size
        self.width = max(vocab_size, self.eos_id + 1)  # the masks' (llguidance's vocabulary)
        self._lock = threading.Lock()
        self._ll = None
        self._sources: dict[tuple[str, str], str] = {}  # (kind, constraint) -> checked grammar
        self._templates: dict[str, object] = {}  # checked grammar -> a matcher at its start, never advanced

    @property
    def ll_tokenizer(self):
        """llguidance's view of the tokenizer (about a second for large vocabularies: made once)."""
        with self._lock:
            if self._ll is None:
                import llguidance.hf

                if self.tokenizer is None:
                    raise GrammarError("structured outputs need the model's tokenizer")
                try:
                    self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.width, eos_token=self.eos_id)
                except ValueError:  # a decoder llguidance does not read: each token's own text
                    self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTexts(self.tokenizer, self.eos_id, self.width)),
                                                      n_vocab=self.width, eos_token=self.eos_id)
            return self._ll

    def source(self, kind: str, value) -> str:
        """A constraint's grammar, checked (GrammarError saying what is wrong); cached by the
        constraint as given (key order kept: a schema's properties come in it)."""
        import llguidance

        key = (kind, value if isinstance(value, str) else json.dumps(value))
        if key in self._sources:
            return self._sources[key]
        grammar = source(kind, value)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if failed:
            raise GrammarError(f"invalid {kind.replace('_', ' ')}: {one_line(messages[0])}")
        if len(self._sources) >= CACHED_GRAMMARS:
            self._sources.pop(next(iter(self._sources)))  # the oldest
        self._sources[key] = grammar
        return grammar

    def matcher(self, grammar: str, stop_ids: frozenset[int], output_ids: Sequence[int] = ()) -> "RowGrammar":
        """A matcher at the start of ``grammar``, advanced by ``output_ids`` (a resumed request):
        a copy of one kept per grammar, which shares what llguidance builds lazily as matchers
        walk the grammar (a request's masks then cost ~45 us where a new matcher's first walk
        cost milliseconds; the copy 2 us against 1.3 ms to make one)."""
        import llguidance

        template = self._templates.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, grammar)
            if len(self._templates) >= CACHED_GRAMMARS:
                self._templates.pop(next(iter(self._templates)), None)  # the oldest
            self._templates[grammar] = template
        row = RowGrammar(template.deep_copy(), self.eos_id, stop_ids, self.vocab_size, self.width)
        for token in output_ids:
            row.advance(token)
        return row


class _TokenTexts:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads one: each token's bytes."""

    def __init__(self, tokenizer, eos_id: int, width: int):
        self.tokenizer, self.eos_token_id, self.bos_token_id = tokenizer, eos_id, tokenizer.bos_token_id
        self.tokens = [tokenizer.decode([i]).encode() for i in range(len(tokenizer))]
        extra = range(len(self.tokens), width)  # ids the tokenizer lacks (the stand-in EOS among them)
        self.tokens += [f"<|specray {i}|>".encode() for i in extra]
        self.special_token_ids = [*tokenizer.all_special_ids, *extra]

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., ceil(V / 32)] int32 bitmask -> [..., V] bool."""
    return torch.from_numpy(_unpack(bitmask.numpy())[..., :vocab].astype(bool))


def _unpack(bitmask: np.ndarray) -> np.ndarray:
    """[..., W] int32 -> [..., 32 W] uint8 0/1, bit j of word w at 32 w + j (one numpy call:
    a row's mask costs a few microseconds, where torch's shift-and-reshape cost a hundred)."""
    return np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little" if sys.byteorder == "little" else "big")


@functools.lru_cache(maxsize=1)
def _executor():
    """llguidance's thread pool (its default size: most of the machine's cores): it fills a batch
    of matchers' masks in one call, with the GIL released."""
    import llguidance

    return llguidance.LLExecutor()


def allowed_masks(rows: Sequence[RowGrammar | None], tokens: Sequence[Sequence[int]],
                  parents: Sequence[Sequence[int] | None], width: int) -> np.ndarray:
    """[R, width, V] bool: what may follow each node of each row, for a whole batch at once.

    rows[i]: row i's grammar (None: a free row, all True); tokens[i]: its nodes' tokens (at most
    ``width``; node 0, the root, is the last kept token: already consumed); parents[i]: its nodes'
    parents (parents first, the root's -1), or None for a chain (node j's parent is j - 1).

    Every row's masks go into one bitmask [R, width, words] zeroed first: root-only rows and
    chains in one llguidance call each (its executor walks a chain's tokens, masks after each
    and rolls back; it stops at the first token the grammar refuses), trees row by row. Then
    one unpack for the batch, the grammar's end mapped onto the rows' stop tokens, and every
    position left with nothing allowed unmasked: a free row's, a padding node's, a node the
    grammar refuses (its mask is never written: the masked target gives that node no mass,
    so what is below it is never accepted) and a complete grammar's without a stop token (the
    request ends there)."""
    live = [r for r in rows if r is not None]
    if not live:
        raise ValueError("allowed_masks needs at least one constrained row")
    eos_id, vocab, words = live[0].eos_id, live[0].vocab, (live[0].width + 31) // 32
    bits = np.zeros((len(rows), width, words), dtype=np.int32)  # [R, width, words]; zero: never written
    roots, chains = [], []
    for i, (row, toks, par) in enumerate(zip(rows, tokens, parents)):
        if row is None:
            continue
        if len(toks) > width:
            raise ValueError(f"row {i} has {len(toks)} nodes, more than the masks' width {width}")
        if len(toks) == 1:
            roots.append((row.matcher, i * width))
        elif par is None:
            chains.append((row.matcher, i * width, list(toks[1:])))
        else:
            row.fill_tree(toks, par, bits[i])
    if roots:
        _executor().unsafe_compute_mask_ptr(roots, bits.ctypes.data, words * 4, len(rows) * width)
    if chains:
        _executor().unsafe_compute_mask_ptr_with_draft_token(chains, bits.ctypes.data, words * 4, len(rows) * width)
    every = _unpack(bits).view(np.bool_)  # [R, width, >= llguidance's vocabulary]
    ends = every[..., eos_id, None].copy()  # [R, width, 1]: the grammar may end after the node
    out = every[..., :vocab]  # [R, width, V]
    # A free row's bits are all zero: any row's tables leave it empty, then all True.
    tables = [(r or live[0]).tables for r in rows]
    if all(t is tables[0] for t in tables):  # one stop set (the model's EOS tokens, mostly)
        keep, stops = tables[0]
    else:
        keep = np.stack([np.ones(vocab, dtype=bool) if k is None else k for k, _ in tables])[:, None]
        stops = np.stack([t for _, t in tables])[:, None]
    if keep is not None:
        out &= keep
    out |= stops & ends
    out |= ~out.any(axis=-1, keepdims=True)
    return out


@functools.lru_cache(maxsize=CACHED_GRAMMARS)
def _stop_tables(eos_id: int, stops: tuple[int, ...], vocab: int) -> tuple[np.ndarray | None, np.ndarray]:
    """[V] bool each, how ``allowed_masks`` reads llguidance's EOS bit ("the grammar may end
    here") for rows with these stop tokens: keep, the tokens a mask's own bit may allow (all
    but the EOS token where it is no stop token; None: all); stops, the tokens allowed where
    the grammar may end. One pair per stop set, shared by its rows (read-only)."""
    keep = None
    if eos_id < vocab and eos_id not in stops:
        keep = np.ones(vocab, dtype=bool)
        keep[eos_id] = False
        keep.flags.writeable = False
    table = np.zeros(vocab, dtype=bool)
    table[list(stops)] = True
    table.flags.writeable = False
    return keep, table


class RowGrammar:
    """One request's matcher: masks for the positions a step scores, and the kept tokens."""

    def __init__(self, matcher, eos_id: int, stop_ids: frozenset[int], vocab: int, width: int):
        self.matcher, self.eos_id, self.vocab, self.width = matcher, eos_id, vocab, width
        self.stops = sorted(t for t in stop_ids if 0 <= t < vocab)
        self.tables = _stop_tables(eos_id, tuple(self.stops), vocab)
        self.ended = False  # the grammar is complete and nothing may follow (no stop token to end on)
        self.refused = 0  # kept tokens the grammar refused (only where a mask left nothing)

    def allowed(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """[n, V] bool: what may follow each node (``allowed_masks`` for this row alone)."""
        return torch.from_numpy(allowed_masks([self], [tokens], [parents], len(tokens))[0])

    def fill_tree(self, tokens: Sequence[int], parents: Sequence[int], bits: np.ndarray) -> None:
        """Write into ``bits`` [>= n, words] int32 what may follow each node of a tree, each from
        the matcher state after its own path; rows of nodes whose path the grammar refuses are
        left as they are. The matcher ends where it started."""
        n = len(tokens)
        valid = [True] * n
        chains = [self._path(j, parents) for j in range(n)]  # each node's path below the root
        path: list[int] = []  # nodes consumed beyond the root, root-most first
        for j in sorted(range(n), key=lambda j: len(chains[j])):
            if j > 0:
                if not valid[parents[j]]:
                    valid[j] = False
                    continue
                chain = chains[j]
                common = 0
                while common < min(len(path), len(chain)) and path[common] == chain[common]:
                    common += 1
                if len(path) > common:
                    self.matcher.rollback(len(path) - common)
                    del path[common:]
                for node in chain[common:]:
                    if self.matcher.is_stopped() or self.matcher.validate_tokens([tokens[node]]) != 1:
                        valid[node] = False
                        break
                    self.matcher.consume_token(tokens[node])
                    path.append(node)
                if not valid[j]:
                    continue
            self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data + j * bits.strides[0], bits.strides[0])
        if path:
            self.matcher.rollback(len(path))

    @staticmethod
    def _path(j: int, parents: Sequence[int]) -> list[int]:
        chain = []
        while j > 0:
            chain.append(j)
            j = parents[j]
        return chain[::-1]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar takes in a row from here (the matcher stays put);
        a stop token is taken where the grammar may end."""
        if self.ended:
            return 0
        n = self.matcher.validate_tokens(list(tokens))
        if n < len(tokens) and tokens[n] in self.stops:
            n += self._can_end_after(tokens[:n])
        return n

    def _can_end_after(self, tokens: Sequence[int]) -> int:
        if not self.matcher.consume_tokens(list(tokens)):  # validated above: never refused here
            raise RuntimeError(self.matcher.get_error())
        can = self.matcher.is_accepting()
        if tokens:
            self.matcher.rollback(len(tokens))
        return int(can)

    def forced(self, limit: int) -> list[int]:
        """At most ``limit`` tokens the grammar forces from here: llguidance's fast-forward
        tokens (the bytes every allowed continuation starts with, tokenised canonically; it
        leaves out a last token that the next bytes could still extend), cut before any token
        the matcher refuses or that is no model token (the stand-in EOS among them). The
        matcher stays put."""
        if self.ended or limit <= 0 or self.matcher.is_stopped():
            return []
        tokens = self.matcher.compute_ff_tokens()[:limit]
        if not tokens:
            return []
        n = self.matcher.validate_tokens(tokens)
        kept = 0
        while kept < n and tokens[kept] < self.vocab and tokens[kept] != self.eos_id:
            kept += 1
        return tokens[:kept]

    def advance(self, token: int) -> bool:
        """A kept token: the matcher consumes it (a stop token ends the request: nothing to
        consume). False when the grammar refuses it."""
        if token in self.stops or self.ended:
            return token in self.stops
        if self.matcher.validate_tokens([token]) != 1:
            self.refused += 1
            return False
        self.matcher.consume_token(token)
        if self.matcher.is_stopped() and not self.stops:
            self.ended = True
        return True


# -- the grammar as a drafter ----------------------------------------------------------------------
class ForcedRow(DraftRow):
    """A chain of tokens a row's grammar forces, drafted without a model: deterministic (one-hot
    q, no ``probs``), verified like any draft. Its own type so that metrics count it apart from
    the method's drafts and the speculation-length policy does not learn the method's
    acceptance from it."""


def with_forced(drafts: Sequence[DraftRow], forced: Sequence[ForcedRow | None], on_device: set[int]) -> list[DraftRow]:
    """Each row's draft given the tokens its grammar forces (``forced_drafts``): the method's own
    where it is deterministic (no ``probs``: a drafter that proposes one-hot, or a greedy row) and
    already drafts the forced tokens and more (a path from the root through them with a node
    below it), else the forced tokens alone. A method's draft was proposed from the context
    without the forced tokens: only where its first nodes are those tokens are the nodes below
    them drafted for the context they follow. A sampled drafter's draft is never chosen by its
    tokens' values (that would bias rejection sampling against its q): the forced tokens replace
    it. Rows drafted on the device (``on_device``: their tokens are not on the host yet) keep the
    method's draft whole."""
    out = list(drafts)
    for i, (d, f) in enumerate(zip(drafts, forced)):
        if f is not None and i not in on_device:
            out[i] = d if d.probs is None and d.extra is None and _extends(d, f.tokens) else f
    return out


def _extends(draft: DraftRow, tokens: Sequence[int]) -> bool:
    """Whether ``draft`` has a path from the root through ``tokens`` and a node below it."""
    if draft.size <= len(tokens):
        return False
    if draft.is_chain:
        return draft.tokens[: len(tokens)] == list(tokens)
    kids, node = draft.tree.children, 0
    for t in tokens:
        node = next((c for c in kids[node] if draft.tokens[c - 1] == t), None)
        if node is None:
            return False
    return bool(kids[node])


def forced_drafts(batch: Sequence, capacity: int, limit: int = FORCED_MAX) -> list[ForcedRow | None]:
    """Per batch row, the tokens its grammar forces from its committed state (at most
    ``limit``, and no more nodes than the row may accept: max_tokens and the context), or None
    where nothing is forced or the row is free. batch: running ``Request``s."""
    out: list[ForcedRow | None] = [None] * len(batch)
    for i, r in enumerate(batch):
        if r.grammar is None:
            continue
        room = min(limit, r.remaining - 1, capacity - r.num_tokens)
        tokens = r.grammar.forced(room)
        if tokens:
            out[i] = ForcedRow(tokens)
    return out
