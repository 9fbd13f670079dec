"""Acceptance rules: which draft tokens the target keeps, and the token it adds.

Terms (used throughout specray). For row r with a linear draft d_0 .. d_{K_r - 1},
q_i the distribution d_i was drafted from and p_i the target's distribution at
draft position i (p_{K_r} is the target's distribution after the whole draft):

* **accepted tokens** — the draft tokens kept: the longest prefix d_0 .. d_{n-1}
  that passes the test at every position. Speculative sampling (Leviathan et al.
  2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.
  2023, "Accelerating Large Language Model Decoding with Speculative Sampling")
  accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)); the greedy rule accepts
  d_i iff it equals argmax p_i.
* **recovered token** — at the first rejected position n < K_r, a token sampled
  from norm(max(0, p_n − q_n)) (greedy: argmax p_n) replacing d_n.
* **bonus token** — when all K_r drafts were accepted, a token sampled from p_{K_r}
  (greedy: its argmax), which the target computed for free.

Each row therefore emits its accepted tokens plus exactly one recovered-or-bonus
token, and with the rejection rule the emitted tokens are distributed exactly as if
sampled from the target one at a time (lossless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling import sample_from_uniform, uniforms

# Residual mass max(0, p - q) below this is float rounding (float32 sums of
# probabilities are off by ~1e-7), not a real distribution: sample from p instead.
_RESIDUAL_MASS_EPS = 1e-6


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying a batch of drafts.

    num_accepted: [B] int64, accepted draft tokens per row
    tokens:       [B, K+1] int64; row r's first ``num_accepted[r] + 1`` entries are
                  the emitted tokens (accepted drafts, then the recovered or bonus
                  token); the rest is padding 0.
    """

    num_accepted: torch.Tensor
    tokens: torch.Tensor

    def emitted(self, r: int) -> list[int]:
        """Tokens row ``r`` emits this step."""
        return self.tokens[r, : int(self.num_accepted[r]) + 1].tolist()


def _check_shapes(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor, target: torch.Tensor) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    b, k = draft_tokens.shape
    if draft_lengths.shape != (b,):
        raise ValueError(f"draft_lengths must have shape [{b}], got {tuple(draft_lengths.shape)}")
    if target.dim() != 3 or target.shape[:2] != (b, k + 1):
        raise ValueError(f"target must be [{b}, {k + 1}, V], got shape {tuple(target.shape)}")


def _assemble(
    draft_tokens: torch.Tensor,  # [B, K]
    num_accepted: torch.Tensor,  # [B]
    final: torch.Tensor,  # [B] recovered or bonus token
) -> Acceptance:
    b, k = draft_tokens.shape
    keep = torch.arange(k, device=draft_tokens.device) < num_accepted.unsqueeze(1)  # [B, K]
    tokens = torch.zeros(b, k + 1, dtype=torch.long, device=draft_tokens.device)
    tokens[:, :k] = torch.where(keep, draft_tokens, torch.zeros_like(draft_tokens))
    tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return Acceptance(num_accepted=num_accepted, tokens=tokens)


def _accepted_prefix(ok: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] int64
    # Length of the leading run of True: cumprod zeroes everything after the first False.
    return ok.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(
    drafts: Sequence[Sequence[int]],  # [B][K_r] draft tokens
    best: Sequence[Sequence[int]],  # [B][>= K_r + 1] the target's argmax at each verify position
) -> tuple[list[int], list[list[int]]]:
    """Token-match acceptance for greedy rows: keep d_i while it equals the argmax.

    Returns (accepted count per row, emitted tokens per row): the accepted drafts, then
    the target's argmax at the first mismatch (recovered) or after the last draft
    (bonus). It reads only argmax ids, so a remote target can send those instead of
    logits; plain lists, because at the batch sizes where speculation pays a loop over
    a few ints beats a dozen small tensor ops.

    >>> greedy_accept([[1, 1]], [[1, 0, 1]])  # the second draft token is wrong
    ([1], [[1, 0]])
    """
    if len(drafts) != len(best):
        raise ValueError(f"{len(drafts)} draft rows but {len(best)} target rows")
    accepted, emitted = [], []
    for row, (draft, target) in enumerate(zip(drafts, best)):
        if len(target) < len(draft) + 1:
            raise ValueError(f"row {row}: {len(draft)} draft tokens need {len(draft) + 1} target positions, got {len(target)}")
        n = 0
        while n < len(draft) and draft[n] == target[n]:
            n += 1
        accepted.append(n)
        emitted.append(list(draft[:n]) + [target[n]])
    return accepted, emitted


def rejection_accept(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_lengths: torch.Tensor | Sequence[int],  # [B] int64, <= K
    draft_probs: torch.Tensor | None,  # [B, K, V] float, or None = one-hot drafts
    target_probs: torch.Tensor,  # [B, K+1, V] float (after temperature/top-k/top-p)
    generators: Sequence[torch.Generator | None],  # [B]
    has_probs: torch.Tensor | None = None,  # [B] bool: rows whose draft_probs are real (others one-hot)
) -> Acceptance:
    """Modified rejection sampling (speculative sampling), exact for any q.

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    emit a recovered token from norm(max(0, p_i − q_i)); if all K_r drafts pass emit
    a bonus token from p_{K_r}. ``draft_probs=None`` treats drafts as one-hot
    (q = onehot(d_i)): accept with probability p_i(d_i), recover from p_i with d_i
    zeroed. Row r draws exactly ``draft_lengths[r] + 1`` uniforms from
    ``generators[r]`` (acceptance tests, then the final token), so its result does
    not depend on the rest of the batch.

    >>> p = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])  # target is certain: 1, then 0
    >>> acc = rejection_accept(torch.tensor([[1]]), torch.tensor([1]), None, p, [None])
    >>> acc.emitted(0)
    [1, 0]
    """
    if not isinstance(draft_lengths, torch.Tensor):  # host-known lengths: no read-back
        lengths_list = [int(n) for n in draft_lengths]
        draft_lengths = torch.tensor(lengths_list, dtype=torch.long)
    else:
        lengths_list = draft_lengths.tolist()
    _check_shapes(draft_tokens, draft_lengths, target_probs)
    b, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is not None and draft_probs.shape != (b, k, vocab):
        raise ValueError(f"draft_probs must be [{b}, {k}, {vocab}], got {tuple(draft_probs.shape)}")
    if len(generators) != b:
        raise ValueError(f"need one generator (or None) per row: {b} rows, {len(generators)} generators")
    if any(n < 0 or n > k for n in lengths_list):
        raise ValueError(f"draft_lengths must lie in [0, {k}], got {lengths_list}")

    device = target_probs.device
    lengths = draft_lengths.to(device)
    drafts = draft_tokens.to(device)
    p = target_probs.float()  # [B, K+1, V]

    # Row r: uniforms for its K_r acceptance tests, then one at column K_r for the
    # final token.
    u = uniforms([n + 1 for n in lengths_list], generators, device, width=k + 1)  # [B, K+1]

    p_draft = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K] p_i(d_i)
    one_hot = None if has_probs is None or draft_probs is None else ~has_probs.to(device)[:, None]  # [B, 1]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, K]
        if one_hot is not None:
            q_draft = torch.where(one_hot, 1.0, q_draft)
    # u < p/q  <=>  u * q < p, without dividing by q.
    valid = torch.arange(k, device=device) < lengths.unsqueeze(1)  # [B, K]
    num_accepted = _accepted_prefix((u[:, :k] * q_draft < p_draft) & valid)  # [B]

    # Target distribution at the final position (bonus position when all accepted).
    pos = num_accepted.view(b, 1, 1).expand(b, 1, vocab)
    p_final = p.gather(1, pos).squeeze(1)  # [B, V]
    rejected = (num_accepted < lengths).unsqueeze(1)  # [B, 1]
    if k == 0:
        weights = p_final
    else:
        pos_q = num_accepted.clamp(max=k - 1)  # [B] (clamped rows are bonus rows)
        if draft_probs is None:
            d = drafts.gather(1, pos_q.unsqueeze(1))  # [B, 1]
            q_final = torch.zeros_like(p_final).scatter_(1, d, 1.0)  # [B, V] one-hot
        else:
            q_final = draft_probs.float().gather(1, pos_q.view(b, 1, 1).expand(b, 1, vocab)).squeeze(1)
            if one_hot is not None:
                d = drafts.gather(1, pos_q.unsqueeze(1))  # [B, 1]
                q_final = torch.where(one_hot, torch.zeros_like(p_final).scatter_(1, d, 1.0), q_final)
        residual = (p_final - q_final).clamp(min=0)  # [B, V]
        usable = residual.sum(dim=1, keepdim=True) > _RESIDUAL_MASS_EPS  # [B, 1]
        weights = torch.where(rejected & usable, residual, p_final)
    final_u = u.gather(1, lengths.unsqueeze(1)).squeeze(1)  # [B]
    final = sample_from_uniform(weights, final_u)  # [B]
    return _assemble(drafts, num_accepted, final)
