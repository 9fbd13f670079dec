"""The global suffix tree of suffix decoding: finished requests' outputs, bounded, least
recently used out — one object in a process, or one per engine replica kept in sync with a
shared log (a Ray actor: ``actors/suffix_cache.py``).

* ``GlobalSuffixCache`` — the tree a proposer reads (``tree``) and feeds (``add`` a finished
  output, ``touch`` a sequence a draft came from). Inserting is deferred to ``poll``, which
  the proposer calls once per step and which inserts at most ``insert_tokens_per_poll``
  tokens (at least one sequence), so a burst of finished requests never stalls a step.
  In one process this is all there is; engines that share the object share the tree.
* ``SuffixCacheLog`` — the authority replicas sync with (the Ray actor's state): the cached
  outputs in LRU order and a bounded log of what was added and evicted. ``sync`` takes a
  replica's new outputs and touches and answers with the events since the replica's cursor
  (or a snapshot, if the replica fell behind the log or the log is a new one).
* ``ReplicatedSuffixCache`` — a ``GlobalSuffixCache`` that is one replica of the log: its
  own outputs go into its tree at once and to the log in batches (every
  ``sync_every_requests`` outputs or ``sync_interval_s`` seconds), and the others' come back
  with the answer (outputs due while an answer is pending go on their own, ``push``). The
  exchange goes through a transport whose ``result`` never blocks, so a step never waits for
  it: look-ups are always local.

>>> log = SuffixCacheLog(max_cached_requests=2)
>>> a, b = (ReplicatedSuffixCache(LocalTransport(log), max_tree_depth=8, sync_every_requests=1) for _ in range(2))
>>> _ = a.add([1, 2, 3, 4]); a.poll()  # a's output reaches the log ...
>>> b.poll()                            # ... and, with b's next exchange, b's replica
>>> b.tree.match([1, 2]) != []
True
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict, deque
from typing import Hashable, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from specray.policies.suffix_tree import SuffixTree

# Tokens inserted into a global tree per poll (one step) at most, beyond the first sequence.
INSERT_TOKENS_PER_POLL = 4096


class SuffixCacheConfig(BaseModel):
    """Engine-wide settings of suffix decoding's trees (a request's options are per request).

    shared: the engine replicas of a deployment share one global tree through a Ray actor
    named ``name`` (each keeps a local replica; look-ups never leave it); False: each engine
    keeps its own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tree_depth: int = Field(32, ge=4, le=1024, description="Longest string the trees hold: a match and "
                                "what is drafted after it fit in this many tokens (Arctic's max_tree_depth).")
    max_cached_requests: int = Field(1024, ge=0, description="Finished outputs the global tree keeps (least "
                                     "recently used out); 0: no global tree (each request's own tree only).")
    shared: bool = Field(True, description="One global tree for every engine replica (a Ray actor) instead of "
                         "one per engine.")
    name: str | None = Field(None, min_length=1, description="The shared tree actor's name (replicas with the "
                             "same name share it); default: one per target model and tokenizer.")
    sync_every_requests: int = Field(8, ge=1, description="A replica sends its finished outputs after this many.")
    sync_interval_s: float = Field(2.0, gt=0, description="... or after this many seconds, and pulls the others'.")


class GlobalSuffixCache:
    """The global tree in one process (see the module doc).

    >>> cache = GlobalSuffixCache(max_tree_depth=8, max_cached_requests=1)
    >>> for output in ([1, 2, 3], [4, 5, 6]):
    ...     _ = cache.add(output)
    >>> cache.poll()
    >>> len(cache.tree), cache.tree.match([4, 5]) != [], cache.tree.match([1, 2])
    (1, True, [])
    """

    def __init__(self, max_tree_depth: int = 32, max_cached_requests: int = 1024,
                 insert_tokens_per_poll: int = INSERT_TOKENS_PER_POLL):
        if isinstance(max_cached_requests, bool) or not isinstance(max_cached_requests, int) or max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be an integer >= 0, got {max_cached_requests!r}")
        self.tree = SuffixTree(max_tree_depth)
        self.max_cached_requests = max_cached_requests
        self.insert_tokens_per_poll = insert_tokens_per_poll
        self._lru: OrderedDict[Hashable, None] = OrderedDict()
        self._queue: deque[tuple[Hashable, list[int]]] = deque()
        self._ids = itertools.count()
        # An output already cached is only touched: a retry's answer does not cost a second
        # insertion (about D dict operations per token on repetitive text) nor a second copy.
        self._content: dict[tuple[int, ...], Hashable] = {}
        self._key: dict[Hashable, tuple[int, ...]] = {}

    @property
    def max_tree_depth(self) -> int:
        return self.tree.max_depth

    @property
    def enabled(self) -> bool:
        """False with ``max_cached_requests`` 0: requests draft from their own trees only."""
        return self.max_cached_requests > 0

    def new_id(self) -> Hashable:
        return next(self._ids)

    def add(self, tokens: Sequence[int]) -> Hashable:
        """A finished request's output (inserted at the next ``poll``; one already cached is
        touched instead); returns its id."""
        sid = self._content.get(tuple(tokens))
        if sid is not None:
            self.touch(sid)
            return sid
        sid = self.new_id()
        self._enqueue(sid, list(tokens))
        return sid

    def _enqueue(self, sid: Hashable, tokens: list[int]) -> None:
        key = tuple(tokens)
        self._content.setdefault(key, sid)
        self._key[sid] = key
        self._queue.append((sid, tokens))

    def touch(self, sid: Hashable) -> None:
        """A draft came from ``sid``: it is the most recently used."""
        if sid in self._lru:
            self._lru.move_to_end(sid)

    def poll(self) -> None:
        """Insert queued outputs (within the per-poll budget) and evict beyond the bound."""
        spent = 0
        while self._queue and (spent == 0 or spent + len(self._queue[0][1]) <= self.insert_tokens_per_poll):
            sid, tokens = self._queue.popleft()
            if sid in self.tree:
                continue
            self.tree.extend(sid, tokens)
            self.tree.close(sid)
            self._lru[sid] = None
            spent += len(tokens) + 1
        while len(self._lru) > self.max_cached_requests:
            self.evict(next(iter(self._lru)))

    def evict(self, sid: Hashable) -> None:
        if sid in self._lru:
            del self._lru[sid]
            self.tree.remove(sid)
        else:
            self._queue = deque(item for item in self._queue if item[0] != sid)
        key = self._key.pop(sid, None)
        if key is not None and self._content.get(key) == sid:
            del self._content[key]

    def cached(self) -> list[Hashable]:
        """Ids in the tree, least recently used first."""
        return list(self._lru)


class SuffixCacheLog:
    """The authority of a replicated global tree (the Ray actor's state; see the module doc)."""

    def __init__(self, max_cached_requests: int = 1024, log_limit: int | None = None):
        self.max_cached_requests = max_cached_requests
        self.log_limit = log_limit or 4 * max_cached_requests
        self.epoch = uuid.uuid4().hex
        self._seqs: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._log: list[tuple[str, Hashable, list[int] | None]] = []
        self._base = 0  # the absolute index of _log[0]

    def sync(self, adds: Sequence[tuple[Hashable, list[int]]] = (), touches: Sequence[Hashable] = (),
             cursor: int = 0, epoch: str | None = None) -> dict:
        """Take a replica's outputs and touches; answer with what it has not seen since
        ``cursor``: ``events`` [(kind, id, tokens)], or a ``snapshot`` [(id, tokens)] of the
        whole cache when the cursor is older than the log or of another log (``epoch``)."""
        self.push(adds, touches)
        end = self._base + len(self._log)
        if epoch != self.epoch or cursor < self._base or cursor > end:
            return {"epoch": self.epoch, "cursor": end, "snapshot": list(self._seqs.items())}
        return {"epoch": self.epoch, "cursor": end, "events": self._log[cursor - self._base :]}

    def push(self, adds: Sequence[tuple[Hashable, list[int]]] = (), touches: Sequence[Hashable] = ()) -> None:
        """Take a replica's outputs and touches (no answer: sent while an exchange is pending)."""
        for sid, tokens in adds:
            if sid not in self._seqs:
                self._seqs[sid] = list(tokens)
                self._log.append(("add", sid, self._seqs[sid]))
        for sid in touches:
            if sid in self._seqs:
                self._seqs.move_to_end(sid)
        while len(self._seqs) > self.max_cached_requests:
            sid, _ = self._seqs.popitem(last=False)
            self._log.append(("evict", sid, None))
        if len(self._log) > self.log_limit:
            drop = len(self._log) - self.log_limit
            del self._log[:drop]
            self._base += drop

    def stats(self) -> dict:
        return {"cached": len(self._seqs), "tokens": sum(map(len, self._seqs.values())),
                "log": len(self._log), "epoch": self.epoch}


class Transport(Protocol):
    """How a replica reaches the log: ``send`` starts one ``SuffixCacheLog.sync`` call;
    ``result`` is its answer once there (None before; never blocks; raises if it failed);
    ``push`` calls ``SuffixCacheLog.push`` and forgets it."""

    def send(self, payload: dict) -> None: ...

    def result(self) -> dict | None: ...

    def push(self, payload: dict) -> None: ...


class LocalTransport:
    """The log in this process (tests; the answer is ready at once)."""

    def __init__(self, log: SuffixCacheLog):
        self.log = log
        self._answer = None

    def send(self, payload: dict) -> None:
        self._answer = self.log.sync(**payload)

    def result(self) -> dict | None:
        answer, self._answer = self._answer, None
        return answer

    def push(self, payload: dict) -> None:
        self.log.push(**payload)


class ReplicatedSuffixCache(GlobalSuffixCache):
    """One replica of a ``SuffixCacheLog`` (see the module doc). The log decides evictions;
    the replica also holds the bound itself (by its own LRU) so that its memory stays bounded
    while the log is out of reach."""

    def __init__(self, transport: Transport, max_tree_depth: int = 32, max_cached_requests: int = 1024,
                 sync_every_requests: int = 8, sync_interval_s: float = 2.0,
                 insert_tokens_per_poll: int = INSERT_TOKENS_PER_POLL):
        super().__init__(max_tree_depth, max_cached_requests, insert_tokens_per_poll)
        self.transport = transport
        self.sync_every_requests, self.sync_interval_s = sync_every_requests, sync_interval_s
        self.replica = uuid.uuid4().hex[:12]
        self._outbox: list[tuple[Hashable, list[int]]] = []
        self._touched: set[Hashable] = set()
        self._sent: list[tuple[Hashable, list[int]]] = []  # in the exchange in flight
        self._in_flight = False
        self._cursor, self._epoch = 0, None
        self._last = float("-inf")  # the first exchange is due at once
        self.syncs = 0

    def new_id(self) -> Hashable:
        return f"{self.replica}:{next(self._ids)}"

    def _enqueue(self, sid: Hashable, tokens: list[int]) -> None:
        super()._enqueue(sid, tokens)
        if str(sid).startswith(self.replica):  # this replica's own output: the log must have it
            self._outbox.append((sid, tokens))

    def touch(self, sid: Hashable) -> None:
        super().touch(sid)
        self._touched.add(sid)

    def poll(self) -> None:
        if self._in_flight:
            self._receive()
        now = time.monotonic()
        full = len(self._outbox) >= self.sync_every_requests
        if not self._in_flight and (full or now - self._last >= self.sync_interval_s):
            self._send(now)
        elif full:  # an exchange is pending: send the outputs on their own (an idle engine
            self._push()  # polls no more, and the other replicas should have them now)
        super().poll()

    def _push(self) -> None:
        adds, self._outbox = self._outbox, []
        touched, self._touched = list(self._touched), set()
        try:
            self.transport.push({"adds": adds, "touches": touched})
        except Exception:  # noqa: BLE001 - out of reach: sent again with the next exchange
            self._outbox = adds + self._outbox

    def _send(self, now: float) -> None:
        self._sent, self._outbox = self._outbox, []
        touched, self._touched = list(self._touched), set()
        self._last = now
        try:
            self.transport.send({"adds": self._sent, "touches": touched, "cursor": self._cursor, "epoch": self._epoch})
        except Exception:  # noqa: BLE001 - the log is out of reach: keep serving from the replica
            self._lost()
            return
        self._in_flight = True
        self._receive()

    def _receive(self) -> None:
        try:
            answer = self.transport.result()
        except Exception:  # noqa: BLE001 - the log died: a new one will be started
            self._lost()
            return
        if answer is None:
            return
        self._in_flight, self._sent = False, []
        self.syncs += 1
        self._cursor, self._epoch = answer["cursor"], answer["epoch"]
        if "snapshot" in answer:
            self._apply_snapshot(answer["snapshot"])
        for kind, sid, tokens in answer.get("events", ()):
            if kind == "add":
                if sid not in self._key:
                    self._enqueue(sid, tokens)
            else:
                self.evict(sid)

    def _apply_snapshot(self, items) -> None:
        keep = {sid for sid, _ in items} | {sid for sid, _ in self._outbox}
        for sid in [s for s in self._lru if s not in keep]:
            self.evict(sid)
        for sid, tokens in items:
            if sid not in self._key:
                self._enqueue(sid, tokens)

    def _lost(self) -> None:
        """The log is gone (or unreachable): start over with a new one — this replica's own
        outputs still cached go to it again, the others' it will send themselves."""
        self._in_flight = False
        self._cursor, self._epoch = 0, None
        own = [(sid, self.tree.sequence(sid)) for sid in self._lru if str(sid).startswith(self.replica)]
        self._outbox = list(dict(own + self._sent + self._outbox).items())  # each once, however often lost
        self._sent = []
        reset = getattr(self.transport, "reset", None)
        if reset is not None:
            reset()
