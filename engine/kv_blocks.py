"""Paged KV: which blocks each cache row holds, and the pool they come from (host side).

A paged ``ModelRunner`` (``engine/runner.py``) keeps every layer's keys and values in
fixed-size blocks (``kernels/attention.PagedCache``); this module decides which block holds
which row's positions:

* ``BlockPool`` — ``num_blocks`` blocks with reference counts. A block is free, held by one
  or more rows, or free but still *cached*: it holds a full block of some token prefix
  (hashed below) and is reused when a later row starts with that prefix, until the pool
  needs it for something else (least recently freed first).
* ``BlockTables`` — each row's list of blocks, mirrored into the device table the attention
  reads. A row grows block by block as its length does (``ensure``); rollback of rejected
  draft tokens is the runner's length alone, and a row keeps its blocks (the next step
  writes there again) until it is released (``free``).

Prefix caching (vLLM's scheme): the hash of block j chains the hash of block j-1 with block
j's tokens, so equal hashes mean equal prefixes. A model whose cache entry i depends on
token i+1 too (an EAGLE head reads the target's features at i with the token after it) hashes
its block j with ``shift`` = 1 more token, so its cached blocks are reused exactly where they
are valid, and need not be dropped at a block boundary. Only full blocks of committed tokens
are published; a row never writes below its length, so a shared block is never written.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import torch

DEFAULT_BLOCK_SIZE = 16
KEYS_REMEMBERED = 64  # prompts whose block keys a BlockTables keeps (admission asks before the attach)


class KVCacheFull(RuntimeError):
    """The pool has no free block left for a row that must grow (the scheduler preempts a
    request to make room, ``engine/driver.py``)."""


@dataclass(frozen=True)
class PagingConfig:
    """The paged layout of one model's KV cache.

    block_size: tokens per block.
    num_blocks: blocks in the pool; None = as many as ``num_slots`` contexts of ``capacity``
        tokens need (what the contiguous layout holds).
    prefix_caching: reuse the blocks of cached prefixes.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    prefix_caching: bool = True

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")

    def blocks_for(self, num_slots: int, capacity: int) -> int:
        return self.num_blocks or num_slots * blocks_needed(capacity, self.block_size)


def blocks_needed(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def proposer_paging(target: PagingConfig | None, num_slots: int, extra_capacity: int) -> PagingConfig | None:
    """A proposer model's pool: the target's blocks (it caches the same tokens, shifted at most
    by a few drafted ones) plus every slot's drafting room (``extra_capacity``: tree nodes an
    EAGLE head writes and rolls back) and one block of drafted tokens per slot."""
    if target is None or target.num_blocks is None:
        return target  # None: contiguous; no pool size given: sized from its own context
    extra = blocks_needed(extra_capacity, target.block_size) + 1
    return PagingConfig(target.block_size, target.num_blocks + num_slots * extra, target.prefix_caching)


def chain_hashes(token_ids: Sequence[int], block_size: int, start: int, stop: int, prev: bytes | None) -> list[bytes]:
    """Hashes of blocks start..stop-1 of ``token_ids``, chained from ``prev`` (block start-1's
    hash; None for block 0). Block j's hash covers token_ids[: (j + 1) * block_size]."""
    out = []
    for j in range(start, stop):
        h = hashlib.blake2b(digest_size=16)
        if prev is not None:
            h.update(prev)
        h.update(_pack(token_ids[j * block_size : (j + 1) * block_size]))
        prev = h.digest()
        out.append(prev)
    return out


def _pack(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


def cache_key(chain: bytes, token_ids: Sequence[int], end: int, shift: int) -> bytes:
    """The key a block is cached under: its chain hash, plus the ``shift`` tokens after its
    end (``end`` = the block's last position + 1) for models whose entries read them."""
    if not shift:
        return chain
    return hashlib.blake2b(chain + _pack(token_ids[end : end + shift]), digest_size=16).digest()


class BlockPool:
    """``num_blocks`` blocks: free, held (reference counted), or free and cached."""

    def __init__(self, num_blocks: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self._cached: OrderedDict[int, None] = OrderedDict()  # free, reusable; least recently freed first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.queries = self.hits = 0  # prefix-cache lookups and hits, in tokens (metrics)

    @property
    def num_free(self) -> int:
        """Blocks a row may take now (cached ones are evicted when needed)."""
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks cached under a prefix's key, held or free."""
        return len(self._key_of)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)  # evict the least recently used prefix
            del self._block_of[self._key_of.pop(block)]
        else:
            raise KVCacheFull(f"all {self.num_blocks} KV blocks are in use")
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._key_of:
                self._cached[block] = None
            else:
                self._free.append(block)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest run of ``keys`` cached (nothing is taken)."""
        found = []
        if self.prefix_caching:
            for key in keys:
                block = self._block_of.get(key)
                if block is None:
                    break
                found.append(block)
        return found

    def count(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    def take(self, block: int) -> None:
        """Hold a cached block (a row starts with its prefix)."""
        if self.refs[block] == 0:
            del self._cached[block]
        self.refs[block] += 1

    def publish(self, block: int, key: bytes) -> None:
        """A held block is full of committed tokens: cache it under ``key`` (a block already
        cached under that key wins; this one stays private)."""
        if self.prefix_caching and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def forget(self) -> None:
        """Drop every cached prefix (the model's weights changed: its cached KV is stale)."""
        self._block_of.clear()
        self._key_of.clear()
        self._free.extend(self._cached)
        self._cached.clear()


class BlockTables:
    """Each row's blocks (host lists) and the device table ``[rows + 1, max_blocks]`` the
    attention reads (``PagedCache.table``); unassigned entries point at the scratch block.

    shift: tokens past a block its entries depend on (1 for EAGLE-style heads, see the
    module docstring).
    """

    def __init__(self, pool: BlockPool, table: torch.Tensor, block_size: int, shift: int = 0):
        self.pool, self.table, self.block_size, self.shift = pool, table, block_size, shift
        self._host = table.numpy() if table.device.type == "cpu" else None  # the same memory
        self.scratch_block = pool.num_blocks
        rows = table.shape[0] - 1
        self.rows: list[list[int]] = [[] for _ in range(rows)]
        self._chains: list[list[bytes]] = [[] for _ in range(rows)]  # hash of each published block
        self._pending: list[tuple[int, int, int]] = []  # (row, index, block) not yet on the device
        self._memo: OrderedDict[tuple, list[bytes]] = OrderedDict()  # token prefix -> its keys

    def held(self, row: int) -> int:
        return len(self.rows[row])

    def ensure(self, row: int, tokens: int) -> None:
        """Give ``row`` blocks for its positions 0..tokens-1 (KVCacheFull if the pool runs out:
        the row keeps what it had)."""
        need = blocks_needed(tokens, self.block_size) - len(self.rows[row])
        if need <= 0:
            return
        if need > self.pool.num_free:
            raise KVCacheFull(f"row {row} needs {need} more KV blocks; {self.pool.num_free} of "
                              f"{self.pool.num_blocks} are free")
        for _ in range(need):
            self._assign(row, self.pool.allocate())

    def _assign(self, row: int, block: int) -> None:
        self._pending.append((row, len(self.rows[row]), block))
        self.rows[row].append(block)

    def sync(self) -> None:
        """Write the assignments made since the last sync into the device table (one copy)."""
        if not self._pending:
            return
        if self._host is not None:  # a CPU table, written in place (not two tensors and an index_put)
            for row, col, block in self._pending:
                self._host[row, col] = block
            self._pending.clear()
            return
        rows, cols, blocks = zip(*self._pending)
        self._pending.clear()
        device = self.table.device
        idx = torch.tensor([rows, cols], dtype=torch.long).to(device, non_blocking=True)
        self.table[idx[0], idx[1]] = torch.tensor(blocks, dtype=self.table.dtype).to(device, non_blocking=True)

    def free(self, row: int) -> None:
        blocks = self.rows[row]
        if not blocks:
            return
        self._pending = [p for p in self._pending if p[0] != row]
        for block in blocks:
            self.pool.release(block)
        (self.table if self._host is None else self._host)[row, : len(blocks)] = self.scratch_block
        self.rows[row] = []
        self._chains[row] = []

    def forget(self) -> None:
        """Drop every cached prefix of this pool (its model's weights changed)."""
        self.pool.forget()
        self._chains = [[] for _ in self.rows]

    # -- prefix caching ----------------------------------------------------------------------
    def keys(self, token_ids: Sequence[int], limit: int) -> list[bytes]:
        """Cache keys of the full blocks within token_ids[:limit] (and, with a shift, whose
        next ``shift`` tokens exist). The last few prompts' keys are remembered: admission,
        the prefix lookup and the attach ask for the same ones."""
        return self._hashes(token_ids, limit)[1]

    def _hashes(self, token_ids: Sequence[int], limit: int) -> tuple[list[bytes], list[bytes]]:
        """(chain hashes, cache keys) of the full blocks within token_ids[:limit]."""
        n = min(limit, len(token_ids) - self.shift) // self.block_size
        covered = tuple(token_ids[: n * self.block_size + self.shift]) if n else ()
        hit = self._memo.get(covered)
        if hit is not None:
            self._memo.move_to_end(covered)
            return hit
        chains = chain_hashes(token_ids, self.block_size, 0, n, None)
        keys = [cache_key(c, token_ids, (j + 1) * self.block_size, self.shift) for j, c in enumerate(chains)]
        self._memo[covered] = (chains, keys)
        if len(self._memo) > KEYS_REMEMBERED:
            self._memo.popitem(last=False)
        return chains, keys

    def cached(self, token_ids: Sequence[int], limit: int) -> int:
        """How many leading full blocks of token_ids[:limit] the pool has cached."""
        return len(self.pool.lookup(self.keys(token_ids, limit)))

    def cost(self, token_ids: Sequence[int], limit: int) -> int:
        """Blocks a fresh row holding token_ids would take from the free ones: all its blocks
        but the cached blocks of token_ids[:limit] that other rows hold already."""
        shared = sum(1 for b in self.pool.lookup(self.keys(token_ids, limit)) if self.pool.refs[b] > 0)
        return blocks_needed(len(token_ids), self.block_size) - shared

    def attach(self, row: int, token_ids: Sequence[int], num_blocks: int) -> int:
        """Start an empty row with the first ``num_blocks`` cached blocks of ``token_ids`` (at
        most what is cached); returns the tokens they hold."""
        if self.rows[row]:
            raise RuntimeError(f"row {row} holds blocks: free it before attaching a prefix")
        chains, keys = self._hashes(token_ids, len(token_ids) - 1)  # as a prefill's lookup asks
        blocks = self.pool.lookup(keys[:num_blocks])
        self.pool.count(len(token_ids), len(blocks) * self.block_size)
        for block in blocks:
            self.pool.take(block)
            self._assign(row, block)
        self._chains[row] = chains[: len(blocks)]
        return len(blocks) * self.block_size

    def publishes(self, row: int, num_tokens: int, length: int) -> bool:
        """Whether ``publish`` with ``num_tokens`` tokens would cache a block not cached before."""
        return self._full_blocks(row, num_tokens, length) > len(self._chains[row])

    def _full_blocks(self, row: int, num_tokens: int, length: int) -> int:
        """The row's blocks full of committed tokens (0 without prefix caching: none is cached)."""
        if not self.pool.prefix_caching:
            return 0
        return min(min(length, num_tokens - self.shift) // self.block_size, len(self.rows[row]))

    def publish(self, row: int, token_ids: Sequence[int], length: int) -> None:
        """The row's positions 0..length-1 hold token_ids' entries: cache its full blocks (only
        the ones not published before are hashed)."""
        chain = self._chains[row]
        done, n = len(chain), self._full_blocks(row, len(token_ids), length)
        if n <= done:
            return
        chain += chain_hashes(token_ids, self.block_size, done, n, chain[-1] if chain else None)
        for j in range(done, n):
            key = cache_key(chain[j], token_ids, (j + 1) * self.block_size, self.shift)
            self.pool.publish(self.rows[row][j], key)
