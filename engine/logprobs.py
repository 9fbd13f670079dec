"""Log-probabilities of emitted and prompt tokens under the target's own distribution.

Verification already has what plain decoding would have: the target's logits at the root
and at every draft node, and the root and each accepted node score the *next* emitted
token. So the emitted token j of a step (on the accepted path ``path``) is scored by the
logits at node ``path[j]``, the same position plain decoding scores it at: the numbers equal
plain decoding's to float tolerance, whatever the method, and cost nothing when not asked.

Like vLLM's default (``logprobs_mode="raw_logprobs"``) these are the model's raw
distribution, log_softmax(logits), before temperature, top-k or top-p. An entry is::

    {"id": token, "logprob": float, "top": [[id, logprob], ...]}   # top: the k best, best first

Prompt log-probabilities (``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``) score
prompt token t with the logits at t - 1 of the prefill; the first prompt token has none.
"""

from __future__ import annotations

from typing import Sequence

import torch


def wanted(reqs: Sequence) -> list[int]:
    """Rows that asked for log-probabilities of their tokens."""
    return [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]


def wants_prompt(reqs: Sequence) -> bool:
    """Does any fresh request of a prefill ask for its prompt's log-probabilities?"""
    return any(r.sampling.prompt_logprobs is not None and not r.output_ids for r in reqs)


def entries(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[dict]:
    """logits: [n, V] the target's at the positions scoring ``tokens`` [n]."""
    if not len(tokens):
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if top > 0:
        values, index = lp.topk(min(top, lp.shape[-1]), dim=-1)
        tops = [[[int(i), float(v)] for i, v in zip(ri, rv)] for ri, rv in zip(index.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [{"id": int(t), "logprob": float(c), "top": k} for t, c, k in zip(tokens, chosen, tops)]


def step_entries(reqs: Sequence, logits: dict[int, torch.Tensor] | torch.Tensor, paths: Sequence[Sequence[int]],
                 emitted: Sequence[Sequence[int]]) -> list[list[dict] | None]:
    """Per row: entries of its emitted tokens (None for rows that did not ask).

    logits: [B, m, V] (every row) or {row: [m, V]}; node ``paths[i][j]`` scores ``emitted[i][j]``.
    """
    out: list[list[dict] | None] = [None] * len(reqs)
    for i in wanted(reqs):
        row = logits[i]
        nodes = torch.tensor(list(paths[i])[: len(emitted[i])], dtype=torch.long, device=row.device)
        out[i] = entries(row[nodes], emitted[i], reqs[i].sampling.logprobs)
    return out


def prompt_entries(logits: torch.Tensor, prompt_ids: Sequence[int], top: int) -> list[dict | None]:
    """logits: [q, V] at every prompt position; entry t scores prompt token t (t >= 1)."""
    return [None, *entries(logits[: len(prompt_ids) - 1], prompt_ids[1:], top)]


def split_prefill(logits: torch.Tensor, reqs: Sequence, starts: Sequence[int] | None = None
                  ) -> tuple[torch.Tensor, dict[int, list]]:
    """A prefill scored at every position (logits [B, q, V]) -> the logits at each row's last
    prompt token ([B, 1, V], what sampling the first token reads) and the prompt entries of
    the rows that asked for them. starts: tokens each row took from the prefix cache (rows
    that asked for prompt scores take none)."""
    starts = starts or [0] * len(reqs)
    lens = torch.tensor([len(r.prefill_ids) - n for r, n in zip(reqs, starts)], dtype=torch.long, device=logits.device)
    last = logits[torch.arange(len(reqs), device=logits.device), lens - 1][:, None]
    prompts = {i: prompt_entries(logits[i, : len(r.prompt_ids)], r.prompt_ids, r.sampling.prompt_logprobs)
               for i, r in enumerate(reqs) if r.sampling.prompt_logprobs is not None and not r.output_ids}
    return last, prompts


def every_position(reqs: Sequence, starts: Sequence[int] | None = None) -> torch.Tensor:
    """logits_at [B, q] scoring every new token of a prefill (rows clamp to their length)."""
    q = max(len(r.prefill_ids) - n for r, n in zip(reqs, starts or [0] * len(reqs)))
    return torch.arange(q)[None].expand(len(reqs), -1)
