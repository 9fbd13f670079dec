"""Turning logits into probabilities and probabilities into tokens, per row.

Rows of a batch belong to different requests, so every sampling parameter is a
per-row tensor and every random draw uses the row's own ``torch.Generator``
(``None`` = the global RNG of the device). Random numbers are drawn as uniforms
(``uniforms``) and mapped to tokens by the inverse CDF (``sample_from_uniform``),
so that one seeded request always sees the same stream of draws however the batch
around it is composed, and the mapping itself is one vectorized kernel.
"""

from __future__ import annotations

from typing import Sequence

import torch


def probs_from_logits(
    logits: torch.Tensor,  # [N, V] float
    temperature: torch.Tensor,  # [N] float, > 0
    top_k: torch.Tensor,  # [N] int64, 0 = off
    top_p: torch.Tensor,  # [N] float in (0, 1]
    check: bool = True,
    min_p: torch.Tensor | None = None,  # [N] float in [0, 1], 0 = off; None = off everywhere
) -> torch.Tensor:  # [N, V] float32
    """Sampling distribution per row, in HF ``generate``'s order.

    Temperature first, then min-p when given (vLLM's place for it: drop tokens whose
    probability is below min_p times the most likely one's), then top-k (keep the k largest
    logits, ties with the k-th included), then top-p (keep the smallest prefix of the sorted
    distribution whose mass reaches ``top_p``; the most likely token is always kept). Rows
    may use different parameters; computed in float32.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> p = probs_from_logits(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    >>> [round(x, 3) for x in p[0].tolist()]
    [0.731, 0.269, 0.0, 0.0]
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape [{n}], got {tuple(t.shape)}")
    if check:  # one host read for all checks (callers with validated parameters skip it)
        bad = (temperature <= 0).any() | (top_k < 0).any() | (top_p <= 0).any() | (top_p > 1).any()
        if bool(bad):
            raise ValueError("need temperature > 0, top_k >= 0 and 0 < top_p <= 1 on every row")

    device = logits.device
    scaled = logits.float() / temperature.to(device, torch.float32).unsqueeze(-1)  # [N, V]
    if min_p is not None:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p) (log(0) = -inf keeps every token)
        floor = scaled.amax(dim=-1, keepdim=True) + min_p.to(device, torch.float32).log().unsqueeze(-1)
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))

    # One descending sort serves both filters: top-k masking only removes a tail of
    # the sorted order, so the order stays valid for top-p.
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V] each
    k = top_k.to(device, torch.long)
    k = torch.where((k == 0) | (k > vocab), torch.full_like(k, vocab), k)  # [N]
    kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

    sorted_probs = sorted_logits.softmax(dim=-1)  # [N, V]
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V]
    p = top_p.to(device, torch.float32).unsqueeze(-1)  # [N, 1]
    # Drop a token once the tokens ranked above it already reach top_p. top_p == 1
    # keeps everything (float rounding could otherwise push mass_before past 1).
    drop = (mass_before >= p) & (p < 1.0)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))

    filtered = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)  # [N, V]
    return filtered.softmax(dim=-1)


def uniforms(
    counts: Sequence[int],
    generators: Sequence[torch.Generator | None],
    device: torch.device | str,
    width: int | None = None,
) -> torch.Tensor:  # [N, width] float32
    """Uniform [0, 1) draws: row r gets ``counts[r]`` of them from ``generators[r]``.

    Rows sharing a generator object draw in row order (one call per generator), so
    results are deterministic; a row with its own generator gets the same numbers
    whatever else is in the batch. Columns past ``counts[r]`` are 0. Draws happen on
    the generator's device and are moved to ``device``.

    >>> g = torch.Generator().manual_seed(0)
    >>> uniforms([2, 1], [g, None], "cpu").shape
    torch.Size([2, 2])
    """
    if len(counts) != len(generators):
        raise ValueError(f"{len(counts)} counts but {len(generators)} generators")
    n = len(counts)
    width = max(counts, default=0) if width is None else width
    out = torch.zeros(n * width, dtype=torch.float32, device=device)
    # Group rows by generator identity, keeping row order inside each group.
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for r, g in enumerate(generators):
        groups.setdefault(id(g), (g, []))[1].append(r)
    for g, rows in groups.values():
        row_counts = [counts[r] for r in rows]
        total = sum(row_counts)
        if total == 0:
            continue
        draw_device = g.device if g is not None else torch.device(device)
        u = torch.rand(total, generator=g, device=draw_device).to(device)  # [total]
        cnt = torch.tensor(row_counts, dtype=torch.long, device=device)  # [G]
        starts = torch.tensor(rows, dtype=torch.long, device=device) * width  # [G]
        offsets = torch.arange(total, device=device) - torch.repeat_interleave(cnt.cumsum(0) - cnt, cnt)
        out[torch.repeat_interleave(starts, cnt) + offsets] = u
    return out.view(n, width)


def sample_from_uniform(
    weights: torch.Tensor,  # [N, V] non-negative, need not sum to 1
    u: torch.Tensor,  # [N] uniforms in [0, 1)
) -> torch.Tensor:  # [N] int64
    """Inverse-CDF sampling: the token whose CDF interval contains ``u`` (rows normalized).

    Tokens with zero weight are never returned (given a row with positive mass).

    >>> sample_from_uniform(torch.tensor([[0.0, 1.0, 3.0]]), torch.tensor([0.2])).tolist()
    [1]
    """
    w = weights.float()
    cdf = w.cumsum(dim=-1)  # [N, V]
    target = (u.to(cdf.device, torch.float32) * cdf[:, -1]).unsqueeze(-1)  # [N, 1]
    # First index whose CDF exceeds the target: its weight is positive.
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [N]
    # Rounding can put the target at the total; fall back to the last positive token.
    vocab = w.shape[-1]
    ar = torch.arange(vocab, device=w.device)
    last_positive = torch.where(w > 0, ar, torch.zeros_like(ar)).amax(dim=-1)  # [N]
    return torch.minimum(idx, last_positive)


def sample(
    probs: torch.Tensor,  # [N, V]
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:  # [N] int64
    """One categorical draw per row, using that row's generator (None = global RNG).

    >>> g = torch.Generator().manual_seed(0)
    >>> sample(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), [g, g]).tolist()
    [1, 0]
    """
    if probs.dim() != 2 or probs.shape[0] != len(generators):
        raise ValueError(
            f"probs must be [N, V] with N = len(generators) = {len(generators)}, "
            f"got shape {tuple(probs.shape)}"
        )
    u = uniforms([1] * len(generators), generators, probs.device, width=1)  # [N, 1]
    return sample_from_uniform(probs, u[:, 0])
