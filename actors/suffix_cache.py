"""Suffix decoding's global tree shared by every engine replica: one Ray actor holding the
log (``SuffixCacheLog``), each engine worker a local replica of the tree
(``ReplicatedSuffixCache``) that drafts from its replica only and exchanges finished outputs
and LRU touches with the actor in batches, asynchronously — a step never waits on it.

The actor is named (``SuffixCacheConfig.name``; by default after the target model and
tokenizer) in the ``specray`` namespace and detached, so that every replica of a deployment —
Serve replicas, coordinators of other drivers — finds the same one, and the cache outlives any
of them (``drop_shared_suffix_cache`` removes it). It
reserves no CPU: a sync is a dict merge per batch of outputs. If it dies, the replicas keep
drafting from what they hold, start a new one on their next exchange and send it their own
outputs again.
"""

from __future__ import annotations

import hashlib

import ray

from specray.policies.suffix_cache import GlobalSuffixCache, ReplicatedSuffixCache, SuffixCacheConfig, SuffixCacheLog

NAMESPACE = "specray"


class RayTransport:
    """``ReplicatedSuffixCache``'s transport to the named log actor (created on first use)."""

    def __init__(self, name: str, max_cached_requests: int):
        self.name, self.max_cached_requests = name, max_cached_requests
        self._handle = None
        self._ref = None

    def handle(self):
        if self._handle is None:
            self._handle = ray.remote(SuffixCacheLog).options(
                name=self.name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
            ).remote(self.max_cached_requests)
        return self._handle

    def send(self, payload: dict) -> None:
        if not ray.is_initialized():  # an engine worker used outside Ray: the replica stays local
            raise RuntimeError("Ray is not initialized")
        self._ref = self.handle().sync.remote(**payload)

    def push(self, payload: dict) -> None:
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialized")
        self.handle().push.remote(**payload)

    def result(self) -> dict | None:
        if self._ref is None:
            return None
        done, _ = ray.wait([self._ref], timeout=0)  # never blocks the step
        if not done:
            return None
        ref, self._ref = self._ref, None
        return ray.get(ref)  # raises if the actor died: the replica starts over with a new one

    def reset(self) -> None:
        self._handle, self._ref = None, None


def suffix_cache_for(config: SuffixCacheConfig | dict, model: str = "") -> GlobalSuffixCache:
    """The global tree an engine worker drafts from: a replica of the shared actor's, or (not
    ``shared``) one of its own. Without a name, engines share by ``model`` (target and
    tokenizer): another model's text would only be drafts its target rejects."""
    cfg = SuffixCacheConfig.model_validate(config)
    if not cfg.shared or cfg.max_cached_requests == 0:
        return GlobalSuffixCache(cfg.max_tree_depth, cfg.max_cached_requests)
    name = cfg.name or default_name(model)
    return ReplicatedSuffixCache(RayTransport(name, cfg.max_cached_requests), cfg.max_tree_depth,
                                 cfg.max_cached_requests, cfg.sync_every_requests, cfg.sync_interval_s)


def default_name(model: str) -> str:
    return "specray-suffix-cache-" + hashlib.sha256(model.encode()).hexdigest()[:12]


def shared_suffix_cache(name: str):
    """The shared tree actor's handle, or None if there is none (tests, operations)."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def drop_shared_suffix_cache(name: str) -> bool:
    """Kill the shared tree actor (replicas start a new, empty one on their next exchange)."""
    handle = shared_suffix_cache(name)
    if handle is None:
        return False
    ray.kill(handle, no_restart=True)
    return True
