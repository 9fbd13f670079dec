"""The target's logits as a request samples from them, at every position a step scores.

vLLM's order (``v1/sample/sampler.py``): allowed tokens and logit bias, ``min_tokens`` (the
request's stop tokens held back while it has generated fewer), then the repetition,
frequency and presence penalties; temperature, min-p, top-k and top-p follow in
``kernels/sampling.py``. Greedy rows take the argmax of these logits, sampled rows sample
from them, and acceptance compares drafts against them — so speculation reproduces exactly
the distribution plain decoding with the same parameters samples from.

A verification scores the root and every draft node of a row in one forward. The logits at
node j predict the token after j, so what they are processed with is the history *at j*: the
committed tokens plus the tokens on j's path (``Positions``: the verified tokens, the
ancestor mask, depths), never another branch's. The draft's own distribution q is left as
it is: rejection sampling against the processed p is exact for any q.

One function serves prefill (one position per row), the eager executor and the fixed-shape
device step. Rows that ask for none of this cost nothing and their logits are not copied;
rows that do cost a copy of the batch's logits and [rows, W, V] of counts, built on the
logits' device from the rows' token ids (uploads, no read-back: the device step still reads
once per step).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specray.engine.grammar import allowed_masks
from specray.kernels.logits import apply_penalties, path_counts, token_counts


@dataclass(frozen=True)
class Positions:
    """The positions a verification scores, per row (device tensors).

    tokens: [B, W] int64 node tokens, node 0 the root (the last committed token)
    anc:    [B, W, W] bool, anc[b, j, i]: node i is j's ancestor or j itself
    depth:  [B, W] int64, 0 at the root
    """

    tokens: torch.Tensor
    anc: torch.Tensor
    depth: torch.Tensor


def host_positions(tokens: Sequence[Sequence[int]], layout, device) -> Positions:
    """Positions of an eager verification: its rows' tokens and its layout (mask [B, q, q],
    offsets [B, q]), or None for chains (causal, depth = column)."""
    q = max(map(len, tokens))
    host = np.zeros((len(tokens), q), dtype=np.int64)  # filled in numpy: a torch op per row costs more
    for i, row in enumerate(tokens):
        host[i, : len(row)] = row
    ids = torch.from_numpy(host)
    if layout is None:
        anc, depth = _chain(q)
        anc, depth = anc.expand(len(tokens), q, q), depth.expand(len(tokens), q)
    else:
        anc, depth = layout
    return Positions(ids.to(device), anc.to(device), depth.to(device))


@functools.lru_cache(maxsize=64)
def _chain(q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of q nodes: its ancestor mask [q, q] (causal) and depths [q] (the column)."""
    return torch.ones(q, q, dtype=torch.bool).tril(), torch.arange(q)


def processed(
    logits: torch.Tensor,  # [B, W, V] the target's raw logits
    reqs: Sequence,  # [B] requests (their sampling, prompt, output so far, stop ids)
    positions: Positions | None,  # None: one position per row, right after the committed tokens (prefill)
) -> torch.Tensor:  # [B, W, V]: ``logits`` itself when no row processes its logits
    rows = [i for i, r in enumerate(reqs) if r.sampling.processes_logits]
    if not rows:
        return logits
    _, w, vocab = logits.shape
    device = logits.device
    picked = [reqs[i] for i in rows]
    every = len(rows) == len(reqs)  # then no gather and scatter: x is the output itself
    idx = None if every else torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    # A float32 copy: the raw logits stay as they are (log-probabilities read them).
    x = logits.to(torch.float32, copy=True) if every else logits[idx].float()  # [R, W, V]
    if positions is None:
        depth = torch.zeros(len(rows), w, dtype=torch.long, device=device)
    else:
        depth = positions.depth if every else positions.depth[idx]
    constrained = any(r.grammar is not None for r in picked)
    if constrained:
        x = _grammar_masks(x, picked, rows, positions)
    bias = _bias(picked, vocab)
    if bias is not None:
        x = x + bias.to(device, non_blocking=True)[:, None]
    if any(r.sampling.min_tokens > len(r.output_ids) for r in picked):
        x = _hold_stops(x, picked, depth, vocab)
    if any(r.sampling.penalized for r in picked):
        outputs = token_counts(_padded([r.output_ids for r in picked]).to(device, non_blocking=True), vocab)
        prompts = token_counts(_padded([r.prompt_ids for r in picked]).to(device, non_blocking=True), vocab) > 0
        counts = outputs[:, None].expand(-1, w, -1)  # [R, W, V]
        if positions is not None:
            counts = counts + path_counts(positions.tokens if every else positions.tokens[idx],
                                          positions.anc if every else positions.anc[idx], vocab)
        seen = prompts[:, None] | (counts > 0)
        rep, presence, frequency = (torch.tensor([getattr(r.sampling, name) for r in picked], dtype=torch.float32)
                                    .repeat_interleave(w) for name in
                                    ("repetition_penalty", "presence_penalty", "frequency_penalty"))
        x = apply_penalties(x.reshape(-1, vocab), counts.reshape(-1, vocab), seen.reshape(-1, vocab),
                            rep, presence, frequency).view(len(rows), w, vocab)
    if constrained and bias is not None:  # only allowed_token_ids' -inf leaves a masked position nothing
        x = _dead_ends(x, picked)
    if every:
        return x
    out = logits.to(torch.float32, copy=True)
    out[idx] = x
    return out


def _dead_ends(x: torch.Tensor, reqs: Sequence) -> torch.Tensor:
    """A constrained position where nothing is left (the grammar and allowed_token_ids or a
    -100 bias exclude each other): only the row's stop tokens, so it finishes there (a stop
    token, or — without one — a token its grammar refuses ends it before it is kept); never
    a distribution of -inf alone."""
    dead = ~torch.isfinite(x).any(dim=-1)  # [R, W]
    if not bool(dead.any()):
        return x
    ends = torch.full(x.shape[::2], float("-inf"))  # [R, V]
    for i, r in enumerate(reqs):
        stops = [t for t in r.stop_ids if 0 <= t < x.shape[-1]]
        ends[i, stops if stops else slice(None)] = 0.0
    return torch.where(dead[..., None], ends.to(x.device)[:, None], x)


def _grammar_masks(x: torch.Tensor, reqs: Sequence, rows: Sequence[int], positions: Positions | None) -> torch.Tensor:
    """Structured outputs: -inf outside what each constrained row's grammar allows after each
    node's own path (``engine/grammar.py``: ``allowed_masks``, the batch's masks at once). A
    position where the grammar allows nothing (it is complete and the request has no stop token)
    is left as it is: the request ends there. reqs: the rows processed (x's), rows: their
    indices in the batch (positions')."""
    width = x.shape[1]
    grammars = [r.grammar for r in reqs]
    if positions is None or width == 1:  # the root alone: its mask needs no token
        tokens, parents = [[0]] * len(reqs), [None] * len(reqs)
    else:
        tokens, parents = _nodes(positions, rows)
    start = time.perf_counter()
    allowed = torch.from_numpy(allowed_masks(grammars, tokens, parents, width))  # [R, W, V]
    share = (time.perf_counter() - start) / sum(g is not None for g in grammars)  # each row's part of the batch's
    for r in reqs:
        if r.grammar is not None:
            r.metrics.grammar_mask_s = (r.metrics.grammar_mask_s or 0.0) + share
    return torch.where(allowed.to(x.device, non_blocking=True), x, float("-inf"))


def _nodes(positions: Positions, rows: Sequence[int]) -> tuple[list[list[int]], list[list[int] | None]]:
    """Per row (``rows`` of the batch): its nodes' tokens, and their parents (-1 for the root), or
    None where the row is a chain (node j's parent j - 1), read from the positions at once."""
    tokens = positions.tokens.cpu().numpy()[rows]  # [R, W]
    anc, depth = positions.anc.cpu().numpy()[rows], positions.depth.cpu().numpy()[rows]  # [R, W, W], [R, W]
    width = tokens.shape[1]
    parent = anc & (depth[:, None, :] == depth[:, :, None] - 1)  # [R, W, W]: i is j's parent
    parents = np.where(parent.any(axis=-1), parent.argmax(axis=-1), 0)  # [R, W]
    parents[:, 0] = -1
    chain = (parents == np.arange(-1, width - 1)).all(axis=-1)  # [R]
    return tokens.tolist(), [None if c else p for c, p in zip(chain.tolist(), parents.tolist())]


def _padded(lists: Sequence[Sequence[int]]) -> torch.Tensor:  # [R, L] padded with -1 (token_counts drops it)
    out = torch.full((len(lists), max(1, max(map(len, lists)))), -1, dtype=torch.long)
    for i, ids in enumerate(lists):
        if ids:
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _bias(reqs: Sequence, vocab: int) -> torch.Tensor | None:
    """[R, V] added to the logits: each row's logit_bias, and -inf outside its allowed tokens."""
    if not any(r.sampling.logit_bias or r.sampling.allowed_token_ids is not None for r in reqs):
        return None
    bias = torch.zeros(len(reqs), vocab)
    for i, r in enumerate(reqs):
        s = r.sampling
        if s.allowed_token_ids is not None:
            bias[i] = float("-inf")
            bias[i, s.allowed_token_ids] = 0.0
        if s.logit_bias:
            ids = torch.tensor(list(s.logit_bias), dtype=torch.long)
            bias[i, ids] += torch.tensor(list(s.logit_bias.values()), dtype=torch.float32)
    return bias


def _hold_stops(x: torch.Tensor, reqs: Sequence, depth: torch.Tensor, vocab: int) -> torch.Tensor:
    """min_tokens: -inf on the stop tokens at positions whose token would be generated before
    the row's min_tokens-th (the token after node j is output token len(output) + depth[j]).
    A position left with nothing to sample keeps its stop tokens (allowed_token_ids all stops)."""
    device = x.device
    made = torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.long).to(device, non_blocking=True)
    least = torch.tensor([r.sampling.min_tokens for r in reqs], dtype=torch.long).to(device, non_blocking=True)
    hold = (made[:, None] + depth) < least[:, None]  # [R, W]
    stops = torch.zeros(len(reqs), vocab, dtype=torch.bool)
    for i, r in enumerate(reqs):
        ids = [t for t in r.stop_ids if 0 <= t < vocab]
        if ids:
            stops[i, ids] = True
    held = x.masked_fill(hold[..., None] & stops.to(device, non_blocking=True)[:, None], float("-inf"))
    empty = (held == float("-inf")).all(dim=-1, keepdim=True)
    return torch.where(empty, x, held)
