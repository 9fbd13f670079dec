"""The two numbers that say whether a draft/target pair is worth speculating with.

* alpha: greedy agreement. Along the target's own greedy continuation of held-out
  prompts, the fraction of positions where the draft's argmax equals the target's. Under
  greedy decoding this is the per-token acceptance rate of draft-model speculation.
* c: cost ratio. Time of one single-token decode step of the draft over the target's
  (batch 1, KV cache of a short prompt, one thread, median of many runs). With
  acceptance alpha and k drafted tokens, speculation pays off only when c is small
  (Leviathan et al. 2023, speedup = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1))).

Example::

    >>> alpha = measure_alpha(target, draft, prompt_ids)  # doctest: +SKIP
    >>> c = measure_cost_ratio(draft, target)            # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import torch
from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MeasureConfig:
    """How alpha and c are measured."""

    alpha_prompts: int = 20
    """Held-out prompts for alpha."""
    alpha_new_tokens: int = 64
    """Length of the target's greedy continuation compared per prompt."""
    cost_prompt_tokens: int = 128
    """KV-cache length in front of the timed decode step."""
    cost_warmup: int = 20
    cost_runs: int = 300
    """Timed steps per model (interleaved draft/target so load noise hits both)."""
    loss_tokens: int = 16384
    """Held-out tokens for the reported cross-entropy of each model."""
    loss_window: int = 512


@torch.inference_mode()
def greedy_continuation(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's greedy continuation of ``prompt``; ignores eos on purpose, so every
    prompt contributes exactly ``new_tokens`` positions to alpha."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
    return tokens


@torch.inference_mode()
def measure_alpha(
    target: PreTrainedModel, draft: PreTrainedModel, prompts: list[list[int]], new_tokens: int
) -> float:
    """Greedy agreement along the target's greedy continuation of each prompt.

    Both models are teacher-forced on prompt + continuation in one forward each; the
    argmaxes at the positions that predict the continuation tokens are compared.
    """
    matches = total = 0
    for prompt in prompts:
        seq = prompt + greedy_continuation(target, prompt, new_tokens)
        ids = torch.tensor([seq])  # [1, len(prompt) + new_tokens]
        # Positions len(prompt)-1 .. end-1 predict the continuation tokens.
        keep = new_tokens + 1
        t_pred = target(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1)
        d_pred = draft(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1)
        matches += int((t_pred == d_pred).sum())
        total += new_tokens
    return matches / total


@torch.inference_mode()
def _decode_step_timer(model: PreTrainedModel, prompt: list[int]):
    """A closure timing one cached single-token decode step. The cache is cropped back
    after each step so every timed step sees the same cache length."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)  # [1, 1]

    def step() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            cache.crop(-1)
        return elapsed

    return step


@torch.inference_mode()
def held_out_loss(model: PreTrainedModel, tokens: list[int], window: int) -> float:
    """Mean next-token cross-entropy (nats) over ``tokens`` cut into ``window``-long
    chunks: shows that the target is the better model, not just a different one."""
    ids = torch.tensor(tokens[: len(tokens) // window * window]).view(-1, window)  # [n, w]
    return float(model(input_ids=ids, labels=ids).loss)


def measure_cost_ratio(
    draft: PreTrainedModel, target: PreTrainedModel, prompt: list[int], cfg: MeasureConfig
) -> tuple[float, float, float]:
    """``(c, draft_ms, target_ms)``: median single-token decode step times, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timers = [_decode_step_timer(draft, prompt), _decode_step_timer(target, prompt)]
        for _ in range(cfg.cost_warmup):
            for timer in timers:
                timer()
        times: list[list[float]] = [[], []]
        for _ in range(cfg.cost_runs):
            for i, timer in enumerate(timers):
                times[i].append(timer())
    finally:
        torch.set_num_threads(threads)
    draft_s, target_s = (statistics.median(t) for t in times)
    return draft_s / target_s, draft_s * 1e3, target_s * 1e3
