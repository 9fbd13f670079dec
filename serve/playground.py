"""What the playground needs beyond OpenAI's API: per-step speculation events in streams
(``stream_options.include_speculation``), the methods this server can run, and the page.

A streamed chunk's ``speculation`` lists the steps whose text the chunk carries::

    {"method": "draft", "num_drafted": 4,             # k: draft tokens (tree nodes) verified
     "drafted":  [{"id": 17, "text": "def"}, ...],     # the draft's main line
     "accepted": [{"id": 17, "text": "def"}, ...],     # draft tokens the target kept
     "num_accepted": 2,
     "rejected": [{"id": 9, "text": ":"}, ...],        # main-line drafts after the last kept one
     "bonus": {"id": 30, "text": "("},                 # the target's own token (or None)
     "recovered": true}                                # bonus replaces a rejected draft

Accepted and bonus texts tile the completion: over a stream, in order, they concatenate to
exactly the completion's text, and each chunk's text is exactly its steps' texts. A
step's texts come from the completion text itself (split per token by incremental
decoding), so a character whose bytes span two tokens belongs to the token that completes
it. A stop string ends the completion *before* it: the tokens that spell it are still
listed (their ids are what the target emitted) but their text is cut where the completion
ends, often to ""; so no token's text ever contains the stop string, as the completion
does not. Drafted and rejected tokens never enter the text; their ``text`` is each id
decoded on its own, for display.

Steps are released with the text they make up: while a stop string may still match, the
stream holds text back (as it does without this option) and the steps that made it wait
with it, so a chunk may carry several steps.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

STATIC = pathlib.Path(__file__).parent / "static"
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".png": "image/png"}


def static_files() -> dict[str, tuple[bytes, str]]:
    """The page's files by name (read once; only these are ever served)."""
    return {p.name: (p.read_bytes(), STATIC_TYPES[p.suffix]) for p in sorted(STATIC.iterdir())
            if p.is_file() and p.suffix in STATIC_TYPES}


@dataclass
class _Step:
    event: dict  # the chunk's event, token texts filled in
    tokens: list[dict]  # accepted + bonus token dicts, in order (their texts tile the text)
    end: int  # offset in the completion text just after this step's text


@dataclass
class SpeculationTrack:
    """One choice's steps, each emitted token given its slice of the completion text."""

    tokenizer: object | None
    _ids: list[int] = field(default_factory=list)
    _end: int = 0  # chars of the text handed to tokens so far
    _pending: list[_Step] = field(default_factory=list)
    _prefix: int = 0  # incremental decoding offsets (as the engine's, per token)
    _read: int = 0

    def advance(self, out: dict, sent: int, max_stop: int) -> tuple[int, list[dict]]:
        """One step output of this choice in; (how far the stream may send its text, the
        steps that text completes). ``sent``: chars sent so far; ``max_stop``: the longest
        stop string's length (text that may still start one is held back, as without events)."""
        self.add(out)
        text = out["text"]
        if out["finished"]:
            steps, upto = self.release(len(text), final=text)
            return upto, steps
        steps, end = self.release(len(text) - max_stop + 1 if max_stop else len(text))
        return (sent if end is None else max(sent, end)), steps

    def add(self, out: dict) -> None:
        """Record one step output (a ``RequestOutput`` dict) of this choice."""
        new = list(out["new_token_ids"])
        if not new and out.get("step") is None:
            return  # e.g. the end of an aborted request: no step ran
        step = out.get("step") or _unattributed(new)
        text = out["text"]
        pieces = [self._piece(t) for t in new]
        # The text this step added (with any character held back at the previous step),
        # split along the tokens' own pieces; the last token takes what is left, so the
        # split always tiles the text, whatever the tokenizer does at the seams.
        avail, pos, texts = text[self._end:], 0, []
        for j, piece in enumerate(pieces):
            take = avail[pos:] if j == len(pieces) - 1 else avail[pos:pos + len(piece)]
            texts.append(take)
            pos += len(take)
        self._end = max(self._end, len(text))
        accepted, bonus = list(step["accepted"]), step["bonus"]
        kept = accepted + ([bonus] if bonus is not None else [])
        if kept != new:  # never expected: the engine's event describes exactly these tokens
            accepted, bonus, kept = new[:-1], (new[-1] if new else None), new
        tokens = [{"id": int(t), "text": s} for t, s in zip(kept, texts)]
        event = {
            "method": step["method"],
            "num_drafted": int(step["num_drafted"]),
            "drafted": self._alone(step["drafted"]),
            "accepted": tokens[:len(accepted)],
            "num_accepted": len(accepted),
            "rejected": self._alone(step["rejected"]),
            "bonus": tokens[len(accepted)] if bonus is not None else None,
            "recovered": bool(step["recovered"]),
        }
        self._pending.append(_Step(event, tokens, self._end))

    def release(self, decided: int, final: str | None = None) -> tuple[list[dict], int | None]:
        """(the steps whose text lies within ``decided`` chars, where their text ends; None
        when no step is released).

        final: the finished completion's text: every step goes, token texts cut to it.
        """
        if final is not None:
            cut = len(final)
            for step in self._pending:
                start = step.end - sum(len(t["text"]) for t in step.tokens)
                for t in step.tokens:
                    length = len(t["text"])
                    t["text"] = t["text"][:max(0, cut - start)]
                    start += length
            done, self._pending = self._pending, []
            return [s.event for s in done], cut
        n = 0
        while n < len(self._pending) and self._pending[n].end <= decided:
            n += 1
        done, self._pending = self._pending[:n], self._pending[n:]
        return [s.event for s in done], (done[-1].end if done else None)

    def _piece(self, token: int) -> str:
        """The text one more token adds (holding back an incomplete character)."""
        self._ids.append(int(token))
        if self.tokenizer is None:
            return ""
        ids, decode = self._ids, self.tokenizer.decode
        prefix = decode(ids[self._prefix:self._read], skip_special_tokens=True)
        full = decode(ids[self._prefix:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return full[len(prefix):]

    def _alone(self, ids) -> list[dict]:
        if self.tokenizer is None:
            return [{"id": int(t), "text": ""} for t in ids]
        return [{"id": int(t), "text": self.tokenizer.decode([int(t)])} for t in ids]


def _unattributed(new: list[int]) -> dict:
    """A step output without an event (not expected): its tokens count as the target's."""
    return {"method": None, "num_drafted": 0, "drafted": [], "accepted": new[:-1],
            "rejected": [], "bonus": new[-1] if new else None, "recovered": False}


def methods_listing(engine_config) -> list[dict]:
    """Every registered method: whether this server can run it (and if not, what it needs),
    whether it takes ``num_speculative_tokens`` (k), the named trees it accepts, its options."""
    from specray.kernels.tree import NAMED_TREES
    from specray.policies.eagle import EAGLE_TREES
    from specray.policies.registry import method_spec, registered_methods

    available = engine_config.method_facts()
    names = list(dict.fromkeys([*NAMED_TREES, *EAGLE_TREES]))
    listing = []
    for name in registered_methods():
        spec = method_spec(name)
        fields = spec.options.model_fields
        trees = []
        if "tree" in fields:
            for tree in names:
                try:
                    spec.options.model_validate({"method": name, "tree": tree})
                    trees.append(tree)
                except ValueError:
                    pass
        listing.append({
            "name": name,
            "available": name in available,
            "requirement": "" if name in available else (spec.requirement or "resources this server lacks"),
            "k": "num_speculative_tokens" in fields and name != "none",
            "trees": trees,
            "options": sorted(f for f in fields if f != "method"),
            "example": options_example(fields),
        })
    return listing


PANEL_FIELDS = ("method", "num_speculative_tokens", "tree")  # the page's own inputs; the rest go in "options"
EXAMPLE_OPTIONS = 2


def options_example(fields) -> str:
    """The options box's placeholder: a method's first options beyond the panel's own fields,
    at their defaults, as JSON ("" for a method with none: the box is hidden)."""
    import json

    shown = {name: f.default for name, f in fields.items()
             if name not in PANEL_FIELDS and f.default is not None and isinstance(f.default, (bool, int, float, str))}
    return json.dumps(dict(list(shown.items())[:EXAMPLE_OPTIONS])) if shown else ""
