"""What a drafter learns from: the target's tokens, and what its recipe reads, captured from
served requests (online learning, ``docs/online-learning.md``).

A ``Capture`` watches the step through the executor's taps, for a sample of the requests of
the methods that learn, and assembles one ``Trace`` per request:

* its committed tokens (prompt, then every token the target emitted: verified tokens);
* feature-level drafters (EAGLE, EAGLE-3, Medusa, ReDrafter): the target's hidden states its
  recipe trains on — exactly the ones the commit hands its proposer (``MethodSpec.
  feature_layers``) — at every prompt position and every verified position;
* the draft model (OSD's distillation) and EAGLE-3 (its labels are the target's distribution):
  the target's top-k log-probabilities at every verified position, the teacher distribution
  that produced each emitted token (k <= 20 bounds the bytes), and the request's temperature.

Finished traces wait in an outbox that the engine's owner drains (``take``) and ships off the
step's path: a step only appends views of tensors it computed anyway and takes one top-k over
the captured rows' verified positions. ``TraceBuffer`` is the bounded store they go to (bytes
capped, oldest out), in one process or inside the learner's Ray actor.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from specray.policies.base import CommitRow, PrefillRow
from specray.policies.registry import method_spec, registered_methods

MAX_TOP_K = 20
# Checkpoint kinds whose recipes learn from the target's distribution (top-k at verified positions).
TEACHER_CHECKPOINTS = ("draft", "eagle3")


def capture_kind(method: str) -> str | None:
    """What ``method``'s recipe learns from: "features" (heads on the target's hidden states),
    "topk" (a draft model distilled on the target's distribution), or None (learns nothing)."""
    spec = method_spec(method)
    if spec.needs_features:
        return "features"
    if spec.checkpoint == "draft":
        return "topk"
    return None


def wants_teacher(method: str) -> bool:
    """Whether ``method``'s recipe learns from the target's top-k at verified positions: the
    draft model (OSD's teacher) and EAGLE-3 (its labels, the target's next-token distribution)."""
    return capture_kind(method) is not None and method_spec(method).checkpoint in TEACHER_CHECKPOINTS


def learnable_methods() -> list[str]:
    return [m for m in registered_methods() if capture_kind(m) is not None]


@dataclass(frozen=True)
class CaptureConfig:
    """The engine's side of online learning.

    methods: the drafters that learn (None: every loaded one that can);
    sample_rate: share of their requests captured (chosen by a hash of the request id);
    top_k: teacher log-probabilities kept per verified position (draft model; <= 20);
    min_tokens: shorter requests are not kept;
    max_outbox: finished traces waiting to be shipped (oldest dropped beyond).
    """

    methods: tuple[str, ...] | None = None
    sample_rate: float = 1.0
    top_k: int = 8
    min_tokens: int = 8
    max_outbox: int = 256

    def __post_init__(self):
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {self.sample_rate}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [1, {MAX_TOP_K}], got {self.top_k}")


@dataclass
class Trace:
    """One served request as its drafter's recipe reads it.

    tokens:        [L] committed tokens (prompt + emitted); for a feature method from the first
                   position the target computed (a request started from a cached prefix is
                   kept from there, its prompt cut to what follows the prefix)
    prompt_len:    P
    features:      [L - 1, F] float32 the target's hidden states at positions 0 .. L - 2 (each
                   position's state predicts the next token), feature methods; else None
    topk_ids:      [L - P, k] int64 the target's k most likely tokens at the position that
                   emitted output token j (draft model, EAGLE-3); else None
    topk_logprobs: [L - P, k] float32 their log-probabilities (log_softmax of the raw logits)
    temperature:   the request's sampling temperature (0: greedy), what its tokens were drawn at
    version:       the drafter version that served it
    constrained:   a structured output's grammar masked the target (its tokens are the masked
                   target's; the teacher's top-k, from the raw logits, are not)
    """

    method: str
    tokens: list[int]
    prompt_len: int
    version: str = ""
    features: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    temperature: float = 0.0
    accepted_length: float = 1.0
    finished_at: float = field(default_factory=time.time)
    constrained: bool = False

    @property
    def nbytes(self) -> int:
        n = 8 * len(self.tokens) + 64
        for t in (self.features, self.topk_ids, self.topk_logprobs):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


class TraceBuffer:
    """Finished traces, at most ``max_bytes`` in all: the oldest go first.

    >>> buf = TraceBuffer(max_bytes=200)
    >>> for i in range(5):
    ...     buf.add([Trace("draft", list(range(10)), 4)])
    >>> len(buf), buf.nbytes <= 200, buf.added, buf.dropped
    (1, True, 5, 4)
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._traces: deque[Trace] = deque()
        self.nbytes = 0
        self.added = self.dropped = 0

    def __len__(self) -> int:
        return len(self._traces)

    def add(self, traces: Iterable[Trace]) -> None:
        for t in traces:
            size = t.nbytes
            if size > self.max_bytes:  # could never fit: dropped, and counted
                self.dropped += 1
                continue
            self._traces.append(t)
            self.nbytes += size
            self.added += 1
            while self.nbytes > self.max_bytes:
                old = self._traces.popleft()
                self.nbytes -= old.nbytes
                self.dropped += 1

    def traces(self, method: str | None = None) -> list[Trace]:
        """Oldest first."""
        return [t for t in self._traces if method is None or t.method == method]

    def count(self, method: str) -> int:
        return sum(t.method == method for t in self._traces)

    def clear(self) -> None:
        self._traces.clear()
        self.nbytes = 0

    def stats(self) -> dict:
        return {"traces": len(self), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "added": self.added, "dropped": self.dropped}


@dataclass
class _Open:
    """A captured request's trace while it runs (tensors stay where they were computed)."""

    method: str
    tokens: list[int]
    prompt_len: int
    version: str
    temperature: float = 0.0
    constrained: bool = False
    features: list[torch.Tensor] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)
    drafts: int = 0
    accepted: int = 0


class Capture:
    """The executor's tap that records traces (see the module doc). ``versions`` maps a method
    to the drafter version serving it (set by the engine when it swaps)."""

    def __init__(self, config: CaptureConfig, methods: Sequence[str]):
        self.config = config
        allowed = set(config.methods) if config.methods is not None else None
        self.methods = {m for m in methods if capture_kind(m) is not None and (allowed is None or m in allowed)}
        self.enabled = True  # switched at run time (learning off: nothing new is captured)
        self.versions: dict[str, str] = {}
        self._open: dict[int, _Open] = {}  # slot -> trace
        self._outbox: deque[Trace] = deque(maxlen=config.max_outbox)
        self.captured = 0

    def wants(self, request_id: str, method: str) -> bool:
        if not self.enabled or method not in self.methods or self.config.sample_rate <= 0:
            return False
        h = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "big")
        return h / 2**64 < self.config.sample_rate

    # -- taps ------------------------------------------------------------------------------
    def prefilled(self, reqs: Sequence, logits: torch.Tensor) -> None:
        """logits: [B, 1, V] at each admitted row's last prompt token (its first token's)."""
        for i, r in enumerate(reqs):
            if r.output_ids or not self.wants(r.request_id, r.method):  # resumed requests: not captured
                continue
            self._open[r.slot] = _Open(r.method, [], len(r.prompt_ids), self.versions.get(r.method, "base"),
                                       float(r.sampling.temperature or 0.0), r.sampling.structured_outputs is not None)
            if wants_teacher(r.method):
                self._topk(self._open[r.slot], logits[i, -1:])

    def verified(self, reqs: Sequence, logits: torch.Tensor, paths: Sequence[Sequence[int]],
                 emitted: Sequence[Sequence[int]]) -> None:
        """logits: [B, W, V] the target's at every verified node; node paths[i][j] emitted[i][j]."""
        for i, r in enumerate(reqs):
            t = self._open.get(r.slot)
            if t is None:
                continue
            t.drafts += 1
            t.accepted += len(paths[i]) - 1
            if wants_teacher(t.method):
                nodes = torch.tensor(list(paths[i])[: len(emitted[i])], dtype=torch.long, device=logits.device)
                self._topk(t, logits[i, nodes])

    def handed_over(self, method: str, rows: Sequence[CommitRow | PrefillRow]) -> None:
        """What the commit tells ``method``'s proposer, features included (feature methods)."""
        for row in rows:
            t = self._open.get(row.slot)
            if t is None:
                continue
            if isinstance(row, PrefillRow):
                # From a cached prefix (paged KV; Medusa and ReDrafter, whose heads keep no KV of
                # their own) the target computed no features before ``row.start``: the trace
                # begins there, as a request whose prompt starts at that token.
                cut = row.start if row.features is not None else 0
                t.tokens = list(row.token_ids[cut:]) + [row.first_token]
                t.prompt_len -= cut
            else:
                t.tokens += list(row.tokens)
            if row.features is not None:
                t.features.append(row.features)

    def released(self, slots: Iterable[int]) -> None:
        for s in slots:
            t = self._open.pop(s, None)
            if t is not None and len(t.tokens) - t.prompt_len >= self.config.min_tokens:
                self._outbox.append(self._close(t))
                self.captured += 1

    def take(self) -> list[Trace]:
        """The finished traces not taken yet (tensors on the CPU)."""
        out = list(self._outbox)
        self._outbox.clear()
        return out

    # -- helpers ---------------------------------------------------------------------------
    def _topk(self, t: _Open, logits: torch.Tensor) -> None:  # logits: [n, V]
        lp = torch.log_softmax(logits.float(), dim=-1)
        values, ids = lp.topk(min(self.config.top_k, lp.shape[-1]), dim=-1)
        t.topk_ids.append(ids)
        t.topk_logprobs.append(values)

    def _close(self, t: _Open) -> Trace:
        n_out = len(t.tokens) - t.prompt_len
        feats = ids = lps = None
        if t.features:
            feats = torch.cat(t.features).float().cpu()[: len(t.tokens) - 1]
        if t.topk_ids:
            ids = torch.cat(t.topk_ids).cpu()[:n_out]
            lps = torch.cat(t.topk_logprobs).cpu()[:n_out]
        return Trace(t.method, t.tokens, t.prompt_len, t.version, feats, ids, lps, t.temperature,
                     1.0 + t.accepted / t.drafts if t.drafts else 1.0, constrained=t.constrained)
