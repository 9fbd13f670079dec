"""Verification and acceptance on the device, with one read-back per step.

The eager executor verifies with ``ModelRunner.forward`` and accepts on the host
(``engine/accept.py``), reading the target's argmax ids back per row. Here the target runs
its fixed-shape forward (``engine/graphs.py``), acceptance runs for the whole batch on the
device (``kernels/batch_acceptance.py``: greedy chains and trees, rejection sampling with
or without draft probabilities), accepted tree paths are compacted in the cache on the
device, and the host copies one small int64 buffer:

    [num_accepted | path (W) | emitted (W) | target argmax (W) | verified tokens (W)]

per row, from which it does all its bookkeeping. Drafts made on the device (a draft
model's k tokens, ``DeviceDraft``) reach the target without a host round trip and come
back in the same buffer. Medusa's lossy typical acceptance is the one rule left on the
host (opt-in; it reads its rows' probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from specray.engine import logprobs as L
from specray.engine import step as S
from specray.engine.accept import StepResult, TargetScores, Verified, accept, target_probs
from specray.engine.logits import Positions, processed
from specray.kernels.acceptance import rejection_accept
from specray.kernels.batch_acceptance import (
    BatchAcceptance,
    greedy_accept_batch,
    parent_nodes,
    tree_rejection_accept_batch,
    tree_uniform_count,
)
from specray.kernels.sampling import uniforms
from specray.kernels.tree import TokenTree, device_children, device_layout
from specray.engine.graphs import COMPILED
from specray.policies.compiled import compile_fn, inference
from specray.policies.base import DeviceDraft, DraftRow


@dataclass
class DeviceVerification:
    """What the executor keeps of a device verification until ``apply``."""

    verified: Verified
    features: torch.Tensor  # [Bb, W, H] final-norm hidden states of every verified position
    layers: dict[int, torch.Tensor]  # {k: [Bb, W, H]} the target's tapped layers there
    logits: torch.Tensor | None = None  # [B, W, V] the target's at every verified node (step taps)


@inference  # once for the whole verification: its forwards enter no context of their own
def verify_on_device(target, reqs: Sequence, drafts: Sequence[DraftRow],
                     device_parts: Mapping[str, tuple[list[int], DeviceDraft]]) -> DeviceVerification:
    """One fixed-shape verification of the batch; device_parts: method -> (batch indices,
    the part drafted on the device) for rows whose tokens never left it."""
    static = target.static
    inputs = S.verify_inputs(reqs, drafts)
    device = target.device
    spliced, trees, built = [], [], {}  # built: batch row -> (its DeviceTrees, its index there)
    for idx, part in device_parts.values():
        spliced.append((_batch_rows(idx, device), 1, part.device_tokens))
        for t in part.trees:  # trees built on the device: their structure goes in as tensors
            anc, depth = device_layout(t.parents, t.max_depth)  # [m, T + 1, T + 1], [m, T + 1]
            at = torch.tensor([idx[n] for n in t.rows], dtype=torch.long).to(device, non_blocking=True)
            trees.append((at, anc[:, 1:, 1:], depth[:, 1:]))
            built.update({idx[n]: (t, j) for j, n in enumerate(t.rows)})
    out = static.run([r.slot for r in reqs], inputs.tokens, inputs.layout, spliced, trees=trees,
                     sizes=[d.size for d in drafts])
    batch, (rows_b, width) = len(reqs), out.ids.shape
    raw = out.logits[:batch]  # [B, W, V]
    scored = out.logits  # [Bb, W, V]: the padded batch, as the compiled forward's shapes
    processing = any(r.sampling.processes_logits for r in reqs)
    greedy = all(r.sampling.greedy for r in reqs)
    if processing:  # as each row samples (its history at each node)
        scored = scored.clone()
        scored[:batch] = processed(raw, reqs, Positions(out.ids[:batch], out.tree[:batch], out.offsets[:batch]))
    if out.after and not processing:  # the forward's own graph accepted (``greedy_pass`` its epilogue)
        num, path, emitted_t, best_t, packed = out.after
        if not greedy:  # rejection sampling rewrites them (not inference tensors)
            num, path, emitted_t = num.clone(), path.clone(), emitted_t.clone()
    else:
        sizes = torch.tensor([d.size for d in drafts] + [0] * (rows_b - batch), dtype=torch.long).to(device, non_blocking=True)
        num, path, emitted_t, best_t, packed = _greedy(static.mode, device)(out.ids, out.tree, out.offsets, sizes, scored)
    host_rows: list[int] = []
    # Greedy chains (the common step) need nothing more: the padded rows' read-back is ignored.
    # Sampled rows are accepted again, and trees' accepted paths compacted, over the batch's rows.
    if not greedy or not all(d.is_chain for d in drafts):
        ids, anc, depth = out.ids[:batch], out.tree[:batch], out.offsets[:batch]
        acc = BatchAcceptance(num[:batch], path[:batch], emitted_t[:batch])
        logits = scored[:batch]
        if not greedy:
            host_rows = _sampled(reqs, drafts, device_parts, ids, anc, depth, logits, acc, built)
        if any(not d.is_chain for d in drafts):
            bases = torch.tensor([r.num_tokens - 1 for r in reqs], dtype=torch.long).to(device, non_blocking=True)
            target.compact_paths(out.rows[:batch], bases, acc.path, acc.num_accepted)
        if not greedy:  # rejection sampling rewrote rows of acc
            packed = _pack(acc.num_accepted, acc.path, acc.emitted, best_t[:batch], ids, packed[:batch, 1 + 4 * width :])
    # The one read-back of the step.
    host = packed.tolist()[:batch]
    accepted, emitted, paths, extra_best, filled = [], [], [], [], list(drafts)
    device_rows = {i for idx, _ in device_parts.values() for i in idx}
    for i, row in enumerate(host):
        n = row[0]
        accepted.append(n)
        paths.append(row[1 : n + 2])
        emitted.append(row[1 + width : n + 2 + width])
        d = drafts[i]
        extra_best.append(row[1 + 2 * width + d.size + 1 : 1 + 2 * width + d.size + 1 + len(d.extra.tokens)]
                          if d.extra is not None else None)
        if i in device_rows or i in built:  # drafted on the device: its tokens (and tree) as read back
            tokens = row[2 + 3 * width : 2 + 3 * width + d.size] if i in device_rows else d.tokens
            tree = TokenTree.from_parents(row[2 + 4 * width : 2 + 4 * width + d.size]) if i in built else None
            filled[i] = d.filled(tokens, tree)
    result = StepResult(accepted, emitted, paths)
    if host_rows:  # typical acceptance (lossy, opt-in): the per-row host rule
        scores = TargetScores.from_logits(logits[host_rows], list(range(len(host_rows))))
        part = accept([reqs[i] for i in host_rows], [filled[i] for i in host_rows], scores)
        for j, i in enumerate(host_rows):
            accepted[i], emitted[i], paths[i] = part.num_accepted[j], part.emitted[j], part.paths[j]
    logprobs = L.step_entries(reqs, raw, paths, emitted) if L.wanted(reqs) else None  # rows that asked (raw)
    return DeviceVerification(Verified(result, filled, extra_best, logprobs), out.hidden, out.layers, raw)


def _batch_rows(idx: list[int], device) -> slice | torch.Tensor:
    """Batch rows as an index into the step's inputs: a slice where they are consecutive (the
    common case, every row drafted by one method), which writes by a plain copy, else an index
    tensor."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return slice(idx[0], idx[0] + len(idx))
    return torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True)


def greedy_pass(ids, anc, depth, sizes, logits):
    """Token-match acceptance of the whole padded batch and the step's read-back buffer,
    from the verification's tensors: the target's fixed-shape forward runs it as its
    epilogue, inside its own graph (``LLMEngine`` enables it so), and a step whose rows
    process their logits (penalties) runs it apart on the processed logits (compiled under
    ``step=compile``: one graph, no host work per op). ids [Bb, W], anc [Bb, W, W], depth
    [Bb, W], sizes [Bb], logits [Bb, W, V]. Returns (num_accepted [Bb], path [Bb, W],
    emitted [Bb, W], best [Bb, W], buffer), the buffer per row: [num_accepted | path (W) |
    emitted (W) | target argmax (W) | verified tokens (W) | parents (W)]."""
    best = logits.argmax(dim=-1)  # [Bb, W]
    acc = greedy_accept_batch(ids, anc, depth, sizes, best)
    parents = parent_nodes(anc, depth)
    return acc.num_accepted, acc.path, acc.emitted, best, _pack(acc.num_accepted, acc.path, acc.emitted, best, ids,
                                                               parents)


def _pack(num_accepted, path, emitted, best, ids, parents):
    return torch.cat([num_accepted[:, None], path, emitted, best, ids, parents], dim=1)


_GREEDY: dict[tuple[str, str], object] = {}


def _greedy(mode: str, device: torch.device):
    """``greedy_pass`` as the step mode runs it (compiled once per process and device type
    under compile)."""
    key = (mode, device.type)
    fn = _GREEDY.get(key)
    if fn is None:
        fn = _GREEDY[key] = compile_fn(greedy_pass, device) if mode in COMPILED else greedy_pass
    return fn


def _sampled(reqs, drafts, device_parts, ids, anc, depth, logits, acc: BatchAcceptance, built) -> list[int]:
    """Rejection sampling for the sampled rows, written into ``acc``; returns the rows left
    to the host (typical acceptance)."""
    chains, trees, host = [], [], []
    for i, r in enumerate(reqs):
        if r.sampling.greedy:
            continue
        if getattr(r.speculation, "acceptance", "exact") == "typical" and not drafts[i].is_chain:
            host.append(i)
        elif drafts[i].is_chain:
            chains.append(i)
        else:
            trees.append(i)
    if not chains and not trees:
        return host
    device = ids.device
    width, vocab = ids.shape[1], logits.shape[-1]
    rows = chains + trees
    idx = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    probs = target_probs(logits[idx], [reqs[i] for i in rows], check=False).view(len(rows), width, vocab)  # [S, W, V]
    q = _draft_probs(rows, drafts, device_parts, width, vocab, device)  # [S, W, V] node-aligned or None
    generators = [reqs[i].generator for i in rows]
    parts = []
    if chains:
        n = len(chains)
        k = max(drafts[i].size for i in chains)
        lengths = [drafts[i].size for i in chains]
        res = rejection_accept(ids[idx[:n], 1 : k + 1], lengths, None if q is None else q[:n, 1 : k + 1],
                               probs[:n, : k + 1], generators[:n], has_probs=_has_q(chains, drafts, device_parts))
        col = torch.arange(width, device=device)
        path = torch.where(col[None, :] <= res.num_accepted[:, None], col[None, :], 0)
        emitted = torch.zeros(n, width, dtype=torch.long, device=device)
        emitted[:, : k + 1] = res.tokens
        parts.append(BatchAcceptance(res.num_accepted, path, emitted))
    if trees:
        t = len(trees)
        # (depth, max children) per row: the tree's, or the bounds of a tree built on the device
        bounds = [(built[i][0].max_depth, built[i][0].max_children) if i in built
                  else (drafts[i].structure.max_depth, drafts[i].structure.children_table.shape[1]) for i in trees]
        levels = max(d for d, _ in bounds)
        strides = [c for _, c in bounds]
        counts = [tree_uniform_count(d, c) for d, c in bounds]
        u = uniforms(counts, generators[len(chains):], device)
        kids = torch.full((t, width, max(strides)), -1, dtype=torch.long)
        for j, i in enumerate(trees):
            if i not in built:
                table = drafts[i].structure.children_table
                kids[j, : table.shape[0], : table.shape[1]] = table
        kids = kids.to(device, non_blocking=True)
        for j, i in enumerate(trees):  # device trees: their children, found on the device
            if i in built:
                tree, n = built[i]
                table = device_children(tree.parents[n : n + 1], tree.max_children)[0]  # [T + 1, C]
                kids[j, : table.shape[0], : table.shape[1]] = table
        sel = idx[len(chains):]
        has_q = _has_q(trees, drafts, device_parts)
        parts.append(tree_rejection_accept_batch(
            ids[sel], anc[sel], depth[sel], kids, probs[len(chains):], u,
            strides=torch.tensor(strides).to(device, non_blocking=True),
            finals=torch.tensor([c - 1 for c in counts]).to(device, non_blocking=True), levels=levels,
            draft_probs=None if q is None else q[len(chains):],
            has_q=None if has_q is None else has_q.to(device, non_blocking=True),
        ))
    merged = [torch.cat(parts_field) for parts_field in zip(*((p.num_accepted, p.path, p.emitted) for p in parts))]
    acc.num_accepted[idx] = merged[0]
    acc.path[idx] = merged[1]
    acc.emitted[idx] = merged[2]
    return host


def _draft_probs(rows, drafts, device_parts, width, vocab, device) -> torch.Tensor | None:
    """[S, W, V] the distribution each node was drawn from (node-aligned: column j is node
    j, the root's column unused), or None when no sampled row carries one."""
    by_row = {}
    for idx, part in device_parts.values():
        for n, i in enumerate(idx):
            if part.carries_probs(n):
                by_row[i] = part.device_probs[n]  # [k, V]
    if not any(drafts[i].probs is not None or i in by_row for i in rows):
        return None
    q = torch.zeros(len(rows), width, vocab, device=device)
    for j, i in enumerate(rows):
        p = by_row.get(i, drafts[i].probs)
        if p is not None and drafts[i].size:
            q[j, 1 : 1 + drafts[i].size] = p[: drafts[i].size].to(device, non_blocking=True)
    return q


def _has_q(rows, drafts, device_parts) -> torch.Tensor | None:
    """[S] bool: the row's nodes carry draft probabilities (else they are one-hot proposals)."""
    with_q = {i for idx, part in device_parts.values() for n, i in enumerate(idx) if part.carries_probs(n)}
    flags = [drafts[i].probs is not None or i in with_q for i in rows]
    return torch.tensor(flags) if any(flags) else None
