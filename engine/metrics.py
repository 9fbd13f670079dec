"""Speculation metrics, counted as vLLM counts them.

A *draft* is one step in which a proposer offered at least one token for a request;
*accepted per position* counts, for each draft position i, how often it was accepted;
the *mean accepted length* is 1 + accepted / drafts (the bonus token included). Tokens a
grammar forces (``engine/grammar.py``: ``ForcedRow``) are drafts too: they count in every
total, and apart in ``grammar_forced_tokens`` / ``grammar_forced_accepted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


GRAMMAR_FIELDS = ("grammar_compile_s", "grammar_mask_s", "grammar_cut_tokens", "grammar_forced_tokens",
                  "grammar_forced_accepted")
"""Structured outputs' counters: None for a free request (``to_dict``), summed by ``merge``."""


@dataclass
class SpecMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    target_forward_passes: int = 0
    num_generated_tokens: int = 0
    # Paged KV: times the request was preempted (its KV freed, recomputed later), and prompt
    # tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # Online learning (engine/drafter_versions.py): the drafter version serving the request's
    # method at its latest step, and per version [drafts, accepted tokens] of its steps.
    drafter_version: str | None = None
    accepted_by_version: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs (engine/grammar.py): seconds compiling the request's grammar where it
    # entered (0 when cached), and its share of filling each step's masks (made for the batch at
    # once); None: unconstrained.
    grammar_compile_s: float | None = None
    grammar_mask_s: float | None = None
    grammar_cut_tokens: int | None = None  # deterministic draft tokens the grammar refused (cut before verifying)
    # Tokens the grammar forced, drafted without a model (the grammar drafter), and how many
    # of them the target accepted.
    grammar_forced_tokens: int | None = None
    grammar_forced_accepted: int | None = None

    def record_draft(self, num_draft_tokens: int, num_accepted: int, forced: bool = False) -> None:
        """A verified draft; ``forced``: the grammar's (the drafter version gets no credit)."""
        if num_draft_tokens <= 0:
            return
        if forced:
            self.grammar_forced_tokens = (self.grammar_forced_tokens or 0) + num_draft_tokens
            self.grammar_forced_accepted = (self.grammar_forced_accepted or 0) + num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        if self.drafter_version is not None and not forced:
            counts = self.accepted_by_version.setdefault(self.drafter_version, [0, 0])
            counts[0] += 1
            counts[1] += num_accepted

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def merge(self, other: "SpecMetrics") -> None:
        """Add ``other`` into this (totals over requests)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.target_forward_passes += other.target_forward_passes
        self.num_generated_tokens += other.num_generated_tokens
        self.num_preemptions += other.num_preemptions
        self.num_cached_tokens += other.num_cached_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n
        for version, (drafts, accepted) in other.accepted_by_version.items():
            counts = self.accepted_by_version.setdefault(version, [0, 0])
            counts[0] += drafts
            counts[1] += accepted
        for name in GRAMMAR_FIELDS:
            if getattr(other, name) is not None:
                setattr(self, name, (getattr(self, name) or 0) + getattr(other, name))

    @classmethod
    def from_dict(cls, d: dict) -> "SpecMetrics":
        """The counters of a ``to_dict()`` (derived fields ignored)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        # Every step's output carries these: spelled out, as asdict's deep copy cost more
        # than the rest of a compiled step's bookkeeping.
        out = {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
            "target_forward_passes": self.target_forward_passes, "num_generated_tokens": self.num_generated_tokens,
            "num_preemptions": self.num_preemptions, "num_cached_tokens": self.num_cached_tokens,
            "drafter_version": self.drafter_version,
            "accepted_by_version": {k: list(v) for k, v in self.accepted_by_version.items()},
            "mean_accepted_length": self.mean_accepted_length, "acceptance_rate": self.acceptance_rate,
        }
        if self.grammar_compile_s is not None or self.grammar_mask_s is not None:  # a structured output's
            out.update(grammar_compile_s=self.grammar_compile_s, grammar_mask_s=self.grammar_mask_s,
                       grammar_cut_tokens=self.grammar_cut_tokens or 0,
                       grammar_forced_tokens=self.grammar_forced_tokens or 0,
                       grammar_forced_accepted=self.grammar_forced_accepted or 0)
        else:
            out.update(dict.fromkeys(GRAMMAR_FIELDS))
        return out
