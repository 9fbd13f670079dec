"""``specray train medusa``: self-distil Medusa heads on the target's own greedy continuations.

The data (continuations, cached features, held-out split) comes from ``training/base.py``.
Head k (0-based) reads the target's final hidden state at position t and learns the token
at t+k+2; only the heads train (each head's projection starts from the target's LM head,
its residual blocks from the identity): the default 1500 steps took about 2.6 CPU minutes
on the demo target (README, "Results"). A tree is then fitted to the trained heads on the
held-out continuations (``training.fit_tree``). The fit's own estimate assumes what it
measured on teacher-forced ranks carries over to decoding, which overstates it (3.29 estimated
where 2.05 was measured on the demo target), so the report gives only measured numbers: the
engine's mean accepted length on other held-out prompts, for the fitted tree and for each
built-in tree the heads can draft. The fitted tree becomes the heads' default
(``medusa_choices`` in ``config.json``) only if it beats them all; else the best built-in one
does. The result uses the public Medusa layout.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specray.training.base import (  # noqa: F401 (fit_tree re-exported)
    ACCEPTANCE_PROMPTS, PromptSource, SequenceSet, add_common_args, recipe_parser, demo_corpus_prompts, distill_data,
    fit_tree, measure_acceptance,
    optimise, ranks_of, record_acceptance, run_recipe,
)
from specray.kernels.tree import NAMED_TREES
from specray.policies.medusa import MedusaHeads


def head_examples(data: SequenceSet, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features at continuation positions t [N, H] and head k's label x_{t+k+2} [N, K]."""
    pos = data.positions(ahead=num_heads + 1)
    seq, t = pos[:, 0], pos[:, 1]
    labels = torch.stack([data.tokens[seq, t + k + 2] for k in range(num_heads)], dim=-1)
    return data.features[seq, t], labels


def heads_loss(medusa: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor, batch_size: int, gen: torch.Generator):
    """The recipe's loss for ``optimise``: each step, the heads' cross-entropy on ``batch_size``
    random examples (``head_examples``)."""
    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(feats), (batch_size,), generator=gen)
        return F.cross_entropy(medusa(feats[idx]).flatten(0, 1), labels[idx].flatten())

    return loss_at


@torch.no_grad()
def head_ranks(medusa: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor, top: int) -> torch.Tensor:
    """``[N, K]`` rank of each label among head k's top ``top`` (``-1`` when outside)."""
    return torch.cat([ranks_of(medusa(feats[i : i + 8192]), labels[i : i + 8192], top)
                      for i in range(0, len(feats), 8192)])


def train_medusa(
    target: str,
    out: str,
    tokenizer: str | None = None,
    heads: int = 4,
    layers: int = 1,
    steps: int = 1500,
    batch_size: int = 2048,
    lr: float = 3e-3,
    sequences: int = 1024,
    gen_len: int = 128,
    tree_size: int = 16,
    seed: int = 0,
    prompts: PromptSource | None = None,
    measure: bool = True,
    measure_prompts: int = ACCEPTANCE_PROMPTS,
    measure_tokens: int = 64,
) -> dict:
    """Train, fit the tree, pick the default tree by measurement, save; returns a report.
    ``prompts(split, n, seed)`` gives token-id prompts (default: cut from the demo corpus at
    line boundaries). ``measure=False`` keeps the fitted tree unmeasured."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed, prompts)
    feats, labels = head_examples(data.train, heads)
    val_feats, val_labels = head_examples(data.held_out, heads)

    lm_head = data.lm_head
    medusa = MedusaHeads(lm_head.shape[1], lm_head.shape[0], heads, layers)
    for head in medusa.heads:
        head[-1].weight.data.copy_(lm_head)

    final = optimise(medusa.parameters(), heads_loss(medusa, feats, labels, batch_size, gen), steps, lr, "medusa heads")
    medusa.eval()
    ranks = head_ranks(medusa, val_feats, val_labels, top=8)
    top1 = [round((ranks[:, k] == 0).float().mean().item(), 3) for k in range(heads)]
    choices, _ = fit_tree(ranks, tree_size, max_children=8)
    medusa.choices = choices
    medusa.save(out, base_model=target)
    report = {"heads_dir": out, "steps": steps, "final_loss": round(final, 3), "examples": len(feats),
              "held_out_top1_per_head": top1}
    default, measured = "fitted", None
    if measure:
        # Prompts neither trained on nor used to fit the tree (another seed of the held-out split).
        source = prompts or demo_corpus_prompts(tokenizer or target)
        held = [p[-256:] for p in source("held_out", measure_prompts, seed + 2)]
        trees = {name: {"tree": name} for name, tree in NAMED_TREES.items() if max(map(len, tree)) <= heads}
        full = measure_acceptance(target, tokenizer, "medusa", out, {"fitted": {}, **trees},
                                  max_tokens=measure_tokens, prompts=held)
        measured = {name: m["mean_accepted_length"] for name, m in full.items()}
        best = max(trees, key=measured.get, default=None)
        if best is not None and measured[best] >= measured["fitted"]:  # the fit must win to be kept
            default, medusa.choices = best, NAMED_TREES[best]
            medusa.save(out, base_model=target)
        record_acceptance(target, tokenizer, "medusa", out, full[default])
    report.update({
        "default_tree": default, "tree_size": len(medusa.choices),
        # measured by the engine (1 + accepted / drafts), never the fit's estimate
        "expected_accepted_length": measured[default] if measured else None,
        "mean_accepted_length": measured,
        "data_seconds": round(data.seconds, 1), "seconds": round(time.time() - start, 1),
    })
    return report


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train medusa", __doc__)
    add_common_args(p, steps=1500, lr=3e-3)
    p.add_argument("--heads", type=int, default=4, help="Medusa heads: draft positions")
    p.add_argument("--layers", type=int, default=1, help="ResBlocks per head")
    p.add_argument("--batch-size", type=int, default=2048, help="positions per step")
    # train_medusa measures the fitted and the built-in trees itself (it picks the default by them)
    return run_recipe(argv, p, "medusa", lambda a, target, tokenizer: train_medusa(
        target, a.out, tokenizer, heads=a.heads, layers=a.layers, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
        sequences=a.sequences, gen_len=a.gen_len, tree_size=a.tree_size, seed=a.seed, measure=not a.no_eval), {})

if __name__ == "__main__":
    import sys

    sys.exit(main())
