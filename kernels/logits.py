"""The tensor math of logit processing: token counts, the counts along a verified path, and
the penalties applied from them (vLLM's and OpenAI's definitions).

A speculative step scores many positions of a row at once — the root and every draft node —
and the target's distribution at a node depends on the tokens before *that node*: the
committed tokens plus the node's own path. So counts come in two parts: the committed
tokens' (``token_counts``, one row per request) and each node's path (``path_counts``, from
the verification's ancestor mask), summed per node. Nothing here reads a tensor back.
"""

from __future__ import annotations

import torch


def token_counts(
    ids: torch.Tensor,  # [R, L] int64, padded with any value outside [0, vocab)
    vocab: int,
) -> torch.Tensor:  # [R, V] float32
    """How often each token occurs in each row (padding ignored).

    >>> token_counts(torch.tensor([[1, 1, 3, -1]]), 4).tolist()
    [[0.0, 2.0, 0.0, 1.0]]
    """
    r = ids.shape[0]
    valid = (ids >= 0) & (ids < vocab)
    dump = torch.where(valid, ids, vocab)  # padding counts into an extra column, dropped
    out = torch.zeros(r, vocab + 1, dtype=torch.float32, device=ids.device)
    out.scatter_add_(1, dump, valid.float())
    return out[:, :vocab]


def path_counts(
    tokens: torch.Tensor,  # [R, W] int64, node tokens; node 0 is the root (already committed)
    anc: torch.Tensor,  # [R, W, W] bool, anc[r, j, i]: node i is node j's ancestor or j itself
    vocab: int,
) -> torch.Tensor:  # [R, W, V] float32
    """Per node j: the counts of the tokens on its path below the root (j included), which
    the target has seen when it scores the token after j.

    >>> anc = torch.ones(3, 3, dtype=torch.bool).tril()[None]   # a chain root -> 1 -> 2
    >>> path_counts(torch.tensor([[0, 2, 2]]), anc, 3)[0].tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 2.0]]
    """
    r, w = tokens.shape
    below = anc.clone()
    below[:, :, 0] = False  # the root is a committed token: counted once, in token_counts
    index = tokens.clamp(0, vocab - 1)[:, None, :].expand(r, w, w)  # [R, W(j), W(i)] token of node i
    out = torch.zeros(r, w, vocab, dtype=torch.float32, device=tokens.device)
    return out.scatter_add_(2, index, below.float())


def apply_penalties(
    logits: torch.Tensor,  # [N, V] float
    output_counts: torch.Tensor,  # [N, V] float, the generated tokens before this position
    seen: torch.Tensor,  # [N, V] bool, the token occurs in the prompt or the generated tokens
    repetition: torch.Tensor,  # [N] float > 0, 1 = off
    presence: torch.Tensor,  # [N] float, 0 = off
    frequency: torch.Tensor,  # [N] float, 0 = off
) -> torch.Tensor:  # [N, V] float32
    """Repetition penalty (CTRL; HF's ``RepetitionPenaltyLogitsProcessor``, vLLM's): a seen
    token's logit is divided by the penalty when positive, multiplied when not; then OpenAI's
    ``logit - frequency * count - presence * (count > 0)`` over the generated tokens.

    >>> apply_penalties(torch.tensor([[2.0, -2.0, 1.0]]), torch.tensor([[1.0, 0.0, 0.0]]),
    ...                 torch.tensor([[True, True, False]]), torch.tensor([2.0]), torch.tensor([0.5]),
    ...                 torch.tensor([0.25])).tolist()
    [[0.25, -4.0, 1.0]]
    """
    x = logits.float()
    rep = repetition.to(x.device, torch.float32)[:, None]  # [N, 1]
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)  # HF's very operations (ties break alike)
    x = x - frequency.to(x.device, torch.float32)[:, None] * output_counts
    return x - presence.to(x.device, torch.float32)[:, None] * (output_counts > 0).float()


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[..., V_draft] logits over a target's ``vocab`` tokens: cut (a padded draft head), or
    padded with -inf (tokens the draft cannot propose)."""
    have = logits.shape[-1]
    if have >= vocab:
        return logits[..., :vocab]
    return torch.nn.functional.pad(logits, (0, vocab - have), value=float("-inf"))
