"""Training the demo pair: a 1-layer draft, a deeper target grown from it, then a short
distillation of the draft toward the target.

Why this recipe (one-off trials on 2 CPU cores while it was designed; only the final
alpha and c are measured by the build, in metrics.json): a tiny HF Llama's decode step
on CPU is dominated by per-layer overhead, not width, so the cost ratio c is set by
depth; hence a 1-layer draft and a 12-layer target of the same small width. Growing the
target *from* the trained draft (its extra layers start as exact no-ops) keeps the two
models' predictions close; a target trained from scratch agreed far less in the same
time. A short distillation of the draft on the target's distributions then raises alpha
further for a few seconds of CPU.

Example::

    >>> recipe = DemoRecipe(draft_steps=2, target_steps=2, distill_steps=2)  # a toy run
    >>> draft = train_draft(tokens, recipe, seed=0, eos_id=0, pad_id=1)  # doctest: +SKIP
    >>> target = train_target(draft, tokens, recipe, seed=0)             # doctest: +SKIP
    >>> distill_draft(draft, target, tokens, recipe, seed=0)             # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines the demo pair's weights, apart from the seed and the
    corpus. Its digest is part of the cache key, so changing a field retrains."""

    vocab_size: int = 2048
    """BPE vocabulary, special tokens included."""
    hidden_size: int = 64
    """Width of both models (equal widths are what makes growing the target possible)."""
    intermediate_size: int = 256
    """SwiGLU width."""
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    """Grouped-query attention on purpose: the server's attention code must handle GQA."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    """Tied embeddings keep the checkpoints small (the embedding is a third of a draft)."""
    draft_layers: int = 1
    target_layers: int = 12
    """Depth ratio sets the cost ratio c (per-layer overhead dominates a decode step here);
    the build measures c for 1 vs 12 layers (``specray demo-models`` prints it)."""
    batch_size: int = 16
    seq_len: int = 256
    long_seq_len: int = 1024
    """The last ``long_fraction`` of each run trains at this length (same tokens per
    step), so prompts longer than ``seq_len`` do not fall off a cliff."""
    long_fraction: float = 0.25
    draft_steps: int = 600
    draft_lr: float = 8e-3
    target_steps: int = 450
    target_lr: float = 5e-3
    distill_steps: int = 80
    """Steps of fine-tuning the draft on the target's distributions (see distill_draft)."""
    distill_lr: float = 3e-3
    distill_long_fraction: float = 0.0
    warmup_steps: int = 30
    min_lr_fraction: float = 0.1
    """Cosine decay floor, as a fraction of the peak learning rate."""
    grad_clip: float = 1.0
    threads: int = 1
    """Fixed so the build is bit-reproducible (reduction order depends on threads). One thread:
    a neighbour on a shared machine slows it down by its share of a core at most, where two
    threads on two cores ran many times slower beside one busy process (each step waits for
    its slower thread)."""


def model_config(recipe: DemoRecipe, num_layers: int, eos_id: int, pad_id: int) -> LlamaConfig:
    """The ``LlamaConfig`` of a demo model with ``num_layers`` layers."""
    return LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=recipe.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def _lr_at(step: int, steps: int, peak: float, recipe: DemoRecipe) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_fraction * peak``."""
    if step < recipe.warmup_steps:
        return peak * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, steps - recipe.warmup_steps)
    floor = recipe.min_lr_fraction
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_lm(
    model: LlamaForCausalLM,
    tokens: torch.Tensor,  # [num_tokens] int64, the training split as one stream
    *,
    steps: int,
    lr: float,
    recipe: DemoRecipe,
    seed: int,
    desc: str,
    long_fraction: float | None = None,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> float:
    """Train ``model`` on random windows of ``tokens``; returns the final loss (mean of
    the last 20 steps). The window order comes from a seeded generator, so the run is
    deterministic. ``loss_fn(windows)`` defaults to next-token cross-entropy;
    ``long_fraction`` defaults to the recipe's; ``on_step(step)`` runs after each
    optimizer step (diagnostics)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    if loss_fn is None:
        loss_fn = lambda x: model(input_ids=x, labels=x).loss  # noqa: E731
    if long_fraction is None:
        long_fraction = recipe.long_fraction
    long_from = steps - int(round(steps * long_fraction))
    recent: list[float] = []
    model.train()
    bar = tqdm(range(steps), desc=desc, unit="step", mininterval=1.0, leave=False)
    for step in bar:
        seq = recipe.long_seq_len if step >= long_from else recipe.seq_len
        batch = max(1, recipe.batch_size * recipe.seq_len // seq)
        starts = torch.randint(0, tokens.numel() - seq, (batch,), generator=gen)
        x = torch.stack([tokens[s : s + seq] for s in starts.tolist()])  # [batch, seq]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, recipe)
        loss = loss_fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        recent = (recent + [loss.item()])[-20:]
        if on_step is not None:
            on_step(step)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", seq=seq)
    bar.close()
    model.eval()
    final = sum(recent) / len(recent)
    log.info("%s: %d steps, final loss %.3f", desc, steps, final)
    return final


def train_draft(
    tokens: torch.Tensor, recipe: DemoRecipe, seed: int, eos_id: int, pad_id: int
) -> LlamaForCausalLM:
    """Train the draft from scratch (deterministic from ``seed``)."""
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(model_config(recipe, recipe.draft_layers, eos_id, pad_id))
    train_lm(draft, tokens, steps=recipe.draft_steps, lr=recipe.draft_lr, recipe=recipe,
             seed=seed, desc="demo pair 1/3: draft")
    return draft


def grow_target(draft: LlamaForCausalLM, recipe: DemoRecipe, seed: int) -> LlamaForCausalLM:
    """A ``target_layers`` model computing exactly the draft's function: the draft's
    embeddings, layers and final norm are copied, and each added layer's residual
    outputs (``o_proj``, ``down_proj``) start at zero, so it adds nothing until trained."""
    if recipe.target_layers <= recipe.draft_layers:
        raise ValueError("target_layers must exceed draft_layers to grow a target")
    config = draft.config.to_dict()
    config["num_hidden_layers"] = recipe.target_layers
    torch.manual_seed(seed + 1)
    target = LlamaForCausalLM(LlamaConfig.from_dict(config))
    missing, unexpected = target.load_state_dict(draft.state_dict(), strict=False)
    if unexpected:
        raise RuntimeError(f"draft weights that the target lacks: {unexpected}")
    with torch.no_grad():
        for layer in target.model.layers[recipe.draft_layers :]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


def train_target(
    draft: LlamaForCausalLM, tokens: torch.Tensor, recipe: DemoRecipe, seed: int
) -> LlamaForCausalLM:
    """Grow the target from the trained draft, then train it (deterministic)."""
    target = grow_target(draft, recipe, seed)
    train_lm(target, tokens, steps=recipe.target_steps, lr=recipe.target_lr, recipe=recipe,
             seed=seed + 2, desc="demo pair 2/3: target")
    return target


def distill_draft(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    tokens: torch.Tensor,  # [num_tokens] int64
    recipe: DemoRecipe,
    seed: int,
) -> None:
    """Fine-tune the trained draft toward the target's next-token distributions
    (cross-entropy against the target's softmax, i.e. forward KL up to a constant).

    Why: the draft's job is to guess the target, not the corpus. A short distillation
    after the target is trained raises greedy agreement for a few seconds of CPU (a target
    forward without gradients is much cheaper than a training step).
    """
    if recipe.distill_steps <= 0:
        return
    target.eval()

    def soft_ce(x: torch.Tensor) -> torch.Tensor:  # x: [batch, seq]
        with torch.no_grad():
            p_target = torch.softmax(target(input_ids=x).logits.float(), dim=-1)
        log_q = torch.log_softmax(draft(input_ids=x).logits.float(), dim=-1)
        return -(p_target * log_q).sum(-1).mean()  # [batch, seq, vocab] -> scalar

    train_lm(draft, tokens, steps=recipe.distill_steps, lr=recipe.distill_lr, recipe=recipe,
             seed=seed + 3, desc="demo pair 3/3: distil draft", long_fraction=recipe.distill_long_fraction,
             loss_fn=soft_ce)
