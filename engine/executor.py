"""Where a step's work runs in this process: the target's runner and each method's proposer.

``LocalExecutor`` is the one ``Executor`` (``engine/driver.py``) every layout uses: the
in-process engine and the Ray engine worker hold the target here; proposers are local
objects or Ray proxies. ``ProposerTable`` builds each method's proposer on first use.
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import torch

from specray.engine import logprobs as L
from specray.engine import step as S
from specray.engine.device_step import verify_on_device
from specray.engine.drafter_versions import forget_prefixes
from specray.engine.accept import TargetScores, accept_verified, sampled_rows
from specray.engine.kv_blocks import KVCacheFull
from specray.engine.logits import host_positions, processed
from specray.kernels.tree import TokenTree
from specray.policies.base import EMPTY, Draft, DraftRow, PrefillRow
from specray.policies.registry import method_spec, registered_methods

log = logging.getLogger(__name__)

class LocalExecutor:
    """The target's runner in this process, and each method's proposer (local objects, or
    remote proxies whose ``propose`` returns an awaitable). Proposers that read features sit
    here, beside the target: the hidden states of the last forward never leave the device.

    With a fixed-shape target (``target.static``, ``engine/graphs.py``), verification and
    acceptance run on the device with one read-back per step (``engine/device_step.py``),
    and proposers that can draft on the device (``propose_on_device``) do so; else the
    eager forward and host acceptance (the reference)."""

    def __init__(self, target, proposers: "ProposerTable"):
        self.target = target
        self.proposers = proposers
        self._last = None  # the last forward's features (final norm's, layer taps) rows' methods read
        self._device_parts: dict = {}  # method -> (batch indices, DeviceDraft) of this step
        self._compacted = False  # the last verification kept its paths in the cache already
        self._failed: dict[int, BaseException] = {}  # batch row -> what its proposer raised (last propose)
        # Observers of the step (online learning's capture and feature log, engine/capture.py):
        # told what the target computed anyway; a tap that raises is logged, never fails a row.
        self.taps: list = []
        self._live: dict[int, object] = {}  # slot -> its request (paged KV: tokens to publish)
        self._starts: dict[int, int] = {}  # slot -> cached prefix its last prefill started from
        self.rebuilds_heads = False  # drafter versions (online learning) keep features from position 0

    async def prefill(self, reqs, sampled):
        starts = [self._attach_prefix(r) for r in reqs]
        every = L.every_position(reqs, starts) if L.wants_prompt(reqs) else None  # echo: score the prompt too
        out = self.target.forward([r.slot for r in reqs], [r.prefill_ids[n:] for r, n in zip(reqs, starts)], every,
                                  **self._wants_features(reqs))
        self._last = out
        self._publish([r.slot for r in reqs])  # the target's prompt blocks (a head's follow at its commit)
        logits, prompts = L.split_prefill(out.logits, reqs, starts) if every is not None else (out.logits, {})
        scores = TargetScores.from_logits(logits, sampled, L.wanted(reqs), processed(logits, reqs, None))
        self._tap("prefilled", reqs, logits)
        return replace(scores, prompt_logprobs=prompts)

    async def propose(self, plan):
        pending, parts = {}, {}
        # Local proposers draft here; a remote proxy returns an awaitable, awaited after them
        # (with overlap on, its worker has been drafting ahead since the last verification).
        self._device_parts, self._failed = {}, {}
        for method, (idx, rows) in plan.rows.items():
            proposer = self.proposers.get(method)
            if proposer is None:
                parts[method] = None
                continue
            try:
                if self._device_step and hasattr(proposer, "propose_on_device"):
                    part = proposer.propose_on_device(rows)
                    if part is not None:
                        parts[method] = part
                        self._device_parts[method] = (idx, part)
                        continue
                parts[method] = proposer.propose(rows)
            except Exception:  # noqa: BLE001 - contained below, row by row
                parts[method] = await self._alone(proposer, idx, rows)
            if inspect.isawaitable(parts[method]):
                pending[method] = parts.pop(method)
        for method, awaitable in pending.items():
            try:
                parts[method] = await awaitable  # a remote proxy answers None when its worker is down
            except Exception:  # noqa: BLE001 - a remote proposer raised: row by row
                idx, rows = plan.rows[method]
                parts[method] = await self._alone(self.proposers.get(method), idx, rows)
        return parts

    async def _alone(self, proposer, idx, rows) -> Draft:
        """A proposer raised on a batch: draft each row alone; the rows that still raise get no
        draft (they decode plainly this step) and are reported in ``failed_rows`` — except a
        proposer whose own KV pool is full (paged KV), which only costs those rows a draft."""
        drafts = []
        for i, row in zip(idx, rows):
            try:
                part = proposer.propose([row])
                if inspect.isawaitable(part):
                    part = await part
                drafts.append(part.rows[0] if part is not None else EMPTY)
            except KVCacheFull as exc:
                log.warning("%s: no draft for slot %d this step (%s)", type(proposer).__name__, row.slot, exc)
                drafts.append(EMPTY)
            except Exception as exc:  # noqa: BLE001
                self._failed[i] = exc
                drafts.append(EMPTY)
        return Draft(drafts)

    def failed_rows(self):
        return self._failed

    def drafts_on_device(self, method: str) -> bool:
        """Whether ``method``'s proposer drafts on the device this step mode (its tokens stay there
        until the verification's read-back)."""
        return self._device_step and hasattr(self.proposers.get(method), "propose_on_device")

    async def verify(self, reqs, drafts):
        for r in reqs:
            self._live[r.slot] = r
        lengths = {r.slot: self.target.lengths[r.slot] for r in reqs}
        try:
            return self._verify(reqs, drafts)
        except Exception:
            for slot, length in lengths.items():  # the target as it was: rows may be retried
                self.target.set_length(slot, length)
            self._compacted = False
            raise

    def _verify(self, reqs, drafts):
        if self._device_step:
            done = verify_on_device(self.target, reqs, drafts, self._device_parts)
            self._device_parts, self._compacted = {}, True
            self._last = _Features(done.features, done.layers) if any(self._wants_features(reqs).values()) else None
            self._tap("verified", reqs, done.logits, done.verified.result.paths, done.verified.result.emitted)
            return done.verified
        inputs = S.verify_inputs(reqs, drafts)
        out = self.target.forward([r.slot for r in reqs], inputs.tokens, inputs.logits_at, inputs.layout,
                                  **self._wants_features(reqs))
        self._last = out
        scored = out.logits
        if any(r.sampling.processes_logits for r in reqs):  # each node's history: committed tokens + its path
            scored = processed(out.logits, reqs, host_positions(inputs.tokens, inputs.layout, out.logits.device))
        verified = accept_verified(reqs, drafts, TargetScores.from_logits(out.logits, sampled_rows(reqs), L.wanted(reqs),
                                                                          scored))
        self._tap("verified", reqs, out.logits, verified.result.paths, verified.result.emitted)
        return verified

    # -- paged KV: cached prefixes, blocks for a step ---------------------------------------
    def _attach_prefix(self, r) -> int:
        """Start r's slot from the longest prefix of what it prefills that the target's cache and
        the caches of r's feature-reading proposer (an EAGLE head: it needs the target's
        features from where its own cache ends) all hold; returns its length in tokens (0 when
        not paged, nothing is cached, or r wants its prompt scored)."""
        ids = r.prefill_ids
        scored = r.sampling.prompt_logprobs is not None and not r.output_ids
        limit = 0 if scored else len(ids) - 1  # the last token is always computed (its logits)
        head = self._head_runner(r.method)
        if head is not None and self.rebuilds_heads:
            limit = 0  # online learning rebuilds a head's KV from the target's features of every position
        n = self.target.cached_prefix(ids, limit) if limit > 0 else 0
        if n and head is not None:
            n = min(n, head.cached_prefix(ids, limit))
        n = self.target.attach(r.slot, ids, n)
        if head is not None:
            head.attach(r.slot, ids, n)
        r.metrics.num_cached_tokens += n
        self._live[r.slot] = r
        self._starts[r.slot] = n
        return n

    def _head_runner(self, method: str):
        """The paged cache of a proposer that reads the target's features (``runner``), if any."""
        if method == "none" or not method_spec(method).needs_features:
            return None
        runner = getattr(self.proposers.get(method), "runner", None)
        return runner if getattr(runner, "blocks", None) is not None else None

    def reserve(self, reqs, drafts) -> list[int]:
        """Blocks for what verifying ``drafts`` writes (each row's root, nodes and extra nodes);
        returns the batch rows that could not get them (the pool ran out), empty when all fit."""
        if self.target.blocks is None:
            return []
        short = []
        for i, (r, d) in enumerate(zip(reqs, drafts)):
            width = 1 + d.size + (len(d.extra.tokens) if d.extra is not None else 0)
            try:
                self.target.reserve([r.slot], [self.target.lengths[r.slot] + width])
            except KVCacheFull:
                short.append(i)
        return short

    def fits(self):
        """Admission by free blocks: a function telling whether the next waiting request's
        prefill fits the target's pool now (counting what it admitted before), keeping a
        watermark free for the running rows' growth unless nothing else runs."""
        blocks = self.target.blocks
        if blocks is None:
            return None
        free = [blocks.pool.num_free]
        watermark = max(1, blocks.pool.num_blocks // 100) if self._live else 0

        def fits(r) -> bool:
            need = blocks.cost(r.prefill_ids, len(r.prefill_ids) - 1)
            if need > free[0] - watermark:
                return False
            free[0] -= need
            return True

        return fits

    def kv_stats(self) -> dict:
        """The target's pool: blocks, how full, prefix-cache queries and hits (tokens)."""
        blocks = self.target.blocks
        if blocks is None:
            return {}
        pool = blocks.pool
        return {"num_blocks": pool.num_blocks, "block_size": blocks.block_size, "usage": pool.usage,
                "prefix_queries": pool.queries, "prefix_hits": pool.hits}

    def _publish(self, slots) -> None:
        """Rows whose cached tokens grew: their full blocks join the prefix cache (the target's
        and their head's)."""
        for slot in slots:
            r = self._live.get(slot)
            if r is None:
                continue
            tokens = None  # built only where a block filled: it grows with the request
            for runner in (self.target, self._head_runner(r.method)):
                if runner is not None and runner.publishes(slot, r.num_tokens):
                    tokens = r.token_ids if tokens is None else tokens
                    runner.publish(slot, tokens)

    def recover(self, reqs, drafts):
        out = list(drafts)
        for idx, part in self._device_parts.values():  # drafts made on the device: read them back
            tokens = part.device_tokens.tolist()
            trees = {n: parents for t in part.trees for n, parents in zip(t.rows, t.parents.tolist())}
            for n, i in enumerate(idx):
                d = drafts[i]
                probs = None if reqs[i].sampling.greedy or not part.carries_probs(n) else part.device_probs[n][: d.size]
                tree = TokenTree.from_parents(trees[n][: d.size]) if n in trees else d.tree
                out[i] = DraftRow(tokens[n][: d.size], tree, probs, d.extra, d.confidence)
        self._device_parts = {}
        return out

    def apply(self, commit):
        if self._compacted:  # the device kept the paths; the host learns the lengths
            for slot, base, path in commit.target_keep:
                self.target.set_length(slot, base + len(path))
            self._compacted = False
        else:
            self.target.keep(commit.target_keep)
        touched = [slot for slot, _, _ in commit.target_keep]
        failed = {}
        for method, rows in commit.proposer_rows.items():
            proposer = self.proposers.get(method)
            if proposer is None:
                continue
            rows = [(i, self._started(row)) for i, row in rows]
            if method_spec(method).needs_features:
                rows = _with_features(rows, self._features(method))
            rows = [row for _, row in rows]
            self._tap("handed_over", method, rows)
            try:
                _hand_over(proposer, rows)
            except Exception as exc:  # noqa: BLE001 - contained: row by row
                if len(rows) == 1:
                    failed[rows[0].slot] = exc
                    continue
                for row in rows:
                    try:
                        _hand_over(proposer, [row])
                    except Exception as row_exc:  # noqa: BLE001
                        failed[row.slot] = row_exc
        self._last = None
        self._publish(touched + [row.slot for rows in commit.proposer_rows.values() for _, row in rows
                                 if isinstance(row, PrefillRow)])
        return failed

    def _started(self, row):
        """A prefill row says where the target started (a cached prefix); others as they are."""
        if isinstance(row, PrefillRow):
            return replace(row, start=self._starts.pop(row.slot, 0))
        return row

    def release(self, slots):
        for s in slots:
            self.target.reset(s)
            self._live.pop(s, None)
            self._starts.pop(s, None)
        self.proposers.release(slots)
        self._tap("released", slots)

    def _tap(self, event: str, *args) -> None:
        for tap in self.taps:
            try:
                getattr(tap, event)(*args)
            except Exception:  # noqa: BLE001 - observers never fail the step
                log.exception("step tap %s.%s raised", type(tap).__name__, event)

    @property
    def _device_step(self) -> bool:
        return self.target.static is not None

    def _wants_features(self, reqs) -> dict:
        """The forward's feature arguments: the final norm's and/or the layers the batch's methods read."""
        final, layers = False, set()
        for method in {r.method for r in reqs}:
            if method_spec(method).needs_features:
                taps = self.proposers.feature_layers(method)
                final |= taps is None
                layers.update(taps or ())
        return {"features": final, "layers": tuple(sorted(layers))}

    def _features(self, method: str):
        """The last forward's features as ``method`` reads them, [B, q, H] or [B, q, n*H]: one
        concatenation for the batch, not one per row."""
        taps = self.proposers.feature_layers(method)
        if taps is None:
            return self._last.features
        return torch.cat([self._last.layers[k] for k in taps], dim=-1)


@dataclass
class _Features:
    features: torch.Tensor | None  # [B, q, H] final norm's
    layers: Mapping[int, torch.Tensor] | None  # {k: [B, q, H]}


def _hand_over(proposer, rows) -> None:
    """Tell a proposer what its rows kept: prompts that entered (``prefill``), steps (``commit``)."""
    prefill = [row for row in rows if isinstance(row, PrefillRow)]
    commits = [row for row in rows if not isinstance(row, PrefillRow)]
    if prefill and hasattr(proposer, "prefill"):
        proposer.prefill(prefill)
    if commits:
        proposer.commit(commits)


def _with_features(rows, feats):
    """Each (batch index, row) with its new positions' features from ``feats`` [B, q, F]: a
    prompt's, a view; the kept paths of every commit row, copied out by one gather for the
    batch (a copy: a fixed-shape step reuses ``feats``' buffer), not one index per row. It
    runs every step for every row of a feature method, drafting or not (a method switched off
    still hands its features over for its catch-up), so it is written for the host's time: a
    step of one token a row hands over the batch's rows as they are (one copy), any other one
    flat index and one ``index_select``; each row built once."""
    commits = [(i, row) for i, row in rows if not isinstance(row, PrefillRow)]
    parts = iter(())
    if commits and feats.shape[1] == 1:  # one token a row (plain steps, a method switched off): rows as they are
        whole = feats.clone().unbind(0)  # [1, F] each
        parts = iter([whole[i] for i, _ in commits])
    elif commits:
        q = feats.shape[1]
        at = torch.tensor([i * q + p for i, row in commits for p in row.path], device=feats.device)
        parts = iter(feats.flatten(0, 1).index_select(0, at).split([len(row.path) for _, row in commits]))
    return [(i, replace(row, features=feats[i, : len(row.token_ids) - row.start]) if isinstance(row, PrefillRow)
             else row.with_features(next(parts))) for i, row in rows]


class ProposerTable:
    """Each method's proposer in this engine, built on first use from its spec.

    ``overrides`` are proposers supplied from outside (Ray proxies to workers of their own).
    """

    def __init__(self, context, resources: Mapping[str, object], overrides: Mapping[str, object] | None = None):
        self.context, self.resources = context, dict(resources)
        self._built: dict[str, object] = dict(overrides or {})

    def get(self, method: str):
        if method not in self._built:
            spec = method_spec(method)
            if spec.build is None:
                return None
            if spec.checkpoint is not None and method not in self.resources:
                return None
            self._built[method] = spec.build(replace(self.context, resource=self.resources.get(method)))
        return self._built[method]

    @contextmanager
    def swapped(self, method: str, proposer):
        """``proposer`` serves ``method`` inside the block (the engine's own start-up profile)."""
        saved = self._built.get(method)
        self._built[method] = proposer
        try:
            yield
        finally:
            if saved is None:
                self._built.pop(method, None)
            else:
                self._built[method] = saved

    def forget_prefixes(self) -> None:
        """Every built drafter's cached KV blocks dropped (the engine's prefix cache reset)."""
        for method, proposer in self._built.items():
            forget_prefixes(self.resources.get(method), proposer)

    def feature_layers(self, method: str) -> tuple[int, ...] | None:
        """The target layers whose inputs ``method`` reads (None: the final norm's features)."""
        spec = method_spec(method)
        if spec.feature_layers is None or self.get(method) is None:  # built first: it may resolve them
            return None
        return tuple(spec.feature_layers(self.resources[method]))

    def all_feature_layers(self) -> tuple[int, ...]:
        """Every target layer a loaded method reads (``MethodSpec.feature_layers``)."""
        taps = set()
        for m in self.resources:
            if m in registered_methods() and method_spec(m).feature_layers is not None:
                taps.update(self.feature_layers(m) or ())
        return tuple(sorted(taps))

    def release(self, slots: Sequence[int]) -> None:
        for name, proposer in self._built.items():
            for s in slots:
                try:
                    proposer.release(s)
                except Exception:  # noqa: BLE001 - a broken proposer must not keep a slot from others
                    log.exception("%s: releasing slot %d raised", name, s)
