"""Acceptance for a mixed batch: greedy rows by token match, sampled rows by rejection.

Both rules are lossless; rows are grouped only because they need different inputs
(argmax of logits vs. processed target probabilities and, when the proposer sampled,
its draft probabilities).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specray.kernels.acceptance import Acceptance, greedy_accept, rejection_accept
from specray.kernels.sampling import probs_from_logits
from specray.policies.base import Draft


def sampling_tensors(reqs: Sequence) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [N], top_k [N], top_p [N]) of sampled requests."""
    return (
        torch.tensor([r.sampling.temperature for r in reqs], dtype=torch.float32),
        torch.tensor([r.sampling.effective_top_k for r in reqs], dtype=torch.long),
        torch.tensor([r.sampling.top_p for r in reqs], dtype=torch.float32),
    )


def accept(reqs: Sequence, draft: Draft, has_probs: Sequence[bool], logits: torch.Tensor) -> Acceptance:
    """logits: [B, K+1, V] target logits at the last committed token and each draft token."""
    b, k1, vocab = logits.shape
    num_accepted = torch.zeros(b, dtype=torch.long)
    tokens = torch.zeros(b, k1, dtype=torch.long)
    groups = {"greedy": [], "probs": [], "onehot": []}
    for i, r in enumerate(reqs):
        key = "greedy" if r.sampling.greedy else ("probs" if has_probs[i] else "onehot")
        groups[key].append(i)
    for key, idx in groups.items():
        if not idx:
            continue
        at = torch.tensor(idx)
        d_tokens, d_lens = draft.tokens[at], draft.lengths[at]
        if key == "greedy":
            part = greedy_accept(d_tokens, d_lens, logits[at])
        else:
            sub = [reqs[i] for i in idx]
            temperature, top_k, top_p = sampling_tensors(sub)
            flat = logits[at].reshape(-1, vocab)  # [n*(K+1), V]
            probs = probs_from_logits(
                flat, temperature.repeat_interleave(k1), top_k.repeat_interleave(k1), top_p.repeat_interleave(k1)
            ).view(len(idx), k1, vocab)
            d_probs = draft.probs[at] if key == "probs" else None
            part = rejection_accept(d_tokens, d_lens, d_probs, probs, [r.generator for r in sub])
        num_accepted[at] = part.num_accepted.cpu()
        tokens[at] = part.tokens.cpu()
    return Acceptance(num_accepted=num_accepted, tokens=tokens)
