"""``specray train redrafter``: a ReDrafter drafter distilled on the target's own continuations.

The data (greedy continuations, cached final-norm features, held-out split) comes from
``training/base.py``. At a continuation position t the drafter reads the context f_t and
runs its RNN over the target's own next tokens x_{t+1} .. x_{t+L} (teacher forcing, as in
Apple's ``train/model.py``), level k learning x_{t+k+1} — the token the target itself chose
there — by cross-entropy, all levels at once. Apple's recipe: frozen target, ``exit_dim =
2H``, two ResBlocks, an RNN, L = 5. The vocabulary projection's context half starts from the
target's LM head, the ResBlocks from the identity.

Held out, two measurements: per level, the top-1 accuracy along the true continuation
(level k right given levels < k right: what greedy acceptance needs), and the real thing —
beam search from each position, the longest beam prefix that equals the target's own
continuation (the tokens a greedy step would accept), with the nodes the packed tree has,
for several beam shapes. The result is saved in Apple's public layout.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specray.training.base import (
    DistillData, PromptSource, SequenceSet, add_common_args, recipe_parser, distill_data, optimise, run_recipe,
)
from specray.policies.redrafter import Drafter, pack_beams

SHAPES = ((1, 4), (2, 4), (4, 4), (4, 5), (8, 4), (5, 5))  # (num_beams, draft_len_per_beam) measured held out


def windows(data: SequenceSet, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every continuation position t with ``length + 1`` known tokens after it:
    (sequence, t) [P, 2] and the tokens x_{t+1} .. x_{t+length+1} [P, length + 1]."""
    pos = data.positions(ahead=length + 1)
    seq, t = pos[:, 0], pos[:, 1]
    tokens = data.tokens[seq[:, None], t[:, None] + 1 + torch.arange(length + 1)]
    return pos, tokens


def drafter_loss(drafter: Drafter, embed: torch.Tensor, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """context [B, H], tokens [B, L + 1] (x_{t+1} ..): mean cross-entropy of the L levels."""
    logits = drafter.forward_sequence(context, F.embedding(tokens[:, :-1], embed))  # [B, L, V]
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def windows_loss(drafter: Drafter, embed: torch.Tensor, data: SequenceSet, length: int, batch_size: int,
                 gen: torch.Generator):
    """The recipe's loss for ``optimise``: each step, ``drafter_loss`` on ``batch_size`` random
    continuation positions of ``data`` (contexts from its features, ``length`` levels)."""
    pos, tokens = windows(data, length)

    def loss_at(step: int) -> torch.Tensor:
        idx = torch.randint(0, len(pos), (batch_size,), generator=gen)
        return drafter_loss(drafter, embed, data.features[pos[idx, 0], pos[idx, 1]], tokens[idx])

    return loss_at


@torch.no_grad()
def level_accuracy(drafter: Drafter, embed: torch.Tensor, data: SequenceSet, length: int,
                   max_positions: int = 8192) -> tuple[list[float], list[float]]:
    """Held out, along the true continuation: top-1 accuracy per level, and the chain accuracy
    (levels 1..k all right: k drafted tokens accepted)."""
    pos, tokens = windows(data, length)
    pos, tokens = pos[:max_positions], tokens[:max_positions]
    logits = drafter.forward_sequence(data.features[pos[:, 0], pos[:, 1]], F.embedding(tokens[:, :-1], embed))
    right = logits.argmax(-1) == tokens[:, 1:]  # [P, L]
    per_level = right.float().mean(0).tolist()
    chain = right.cumprod(-1).float().mean(0).tolist()
    return [round(x, 3) for x in per_level], [round(x, 3) for x in chain]


@torch.no_grad()
def beam_acceptance(drafter: Drafter, embed: torch.Tensor, data: SequenceSet, shapes=SHAPES, stride: int = 2,
                    max_positions: int = 4096) -> dict:
    """Per beam shape "MxL": the mean accepted length of a greedy step (1 + the longest beam
    prefix equal to the target's continuation) and the tokens it verifies with the beams
    packed into a tree (root + nodes) and without (M x (L + 1))."""
    table = torch.nn.Embedding.from_pretrained(embed)
    longest = max(l for _, l in shapes)
    pos, tokens = windows(data, longest)
    pos, tokens = pos[::stride][:max_positions], tokens[::stride][:max_positions]
    context = data.features[pos[:, 0], pos[:, 1]]
    out = {}
    for m, length in shapes:
        beams, _ = drafter.beam_search(context, tokens[:, 0], table, m, length)  # [P, M, L]
        match = (beams == tokens[:, None, 1 : length + 1]).cumprod(-1).sum(-1).amax(-1)  # [P]
        nodes = sum(len(pack_beams(b, m * length)[0]) for b in beams.tolist()) / len(beams)
        out[f"{m}x{length}"] = {"accepted_length": round(1 + match.float().mean().item(), 3),
                                "verified_packed": round(1 + nodes, 2), "verified_unpacked": m * (length + 1)}
    return out


def train_redrafter(target: str, out: str, tokenizer: str | None = None, steps: int = 1000, batch_size: int = 512,
                    length: int = 5, layers: int = 2, lr: float = 3e-3, sequences: int = 1024, gen_len: int = 128,
                    seed: int = 0, prompts: PromptSource | None = None, shapes=SHAPES) -> dict:
    """Train, measure held out, save (Apple's layout); returns a report."""
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed, prompts)
    drafter, final = fit(data, steps, batch_size, length, layers, lr, seed)
    per_level, chain = level_accuracy(drafter, data.embed, data.held_out, length)
    beams = beam_acceptance(drafter, data.embed, data.held_out, shapes)
    drafter.save(out, base_model=target)
    return {
        "drafter_dir": out, "steps": steps, "final_loss": round(final, 4), "examples": len(data.train.positions(length + 1)),
        "held_out_top1_per_level": per_level, "held_out_chain_accuracy": chain,
        "held_out_beams": beams, "data_seconds": round(data.seconds, 1), "seconds": round(time.time() - start, 1),
    }


def fit(data: DistillData, steps: int, batch_size: int, length: int, layers: int, lr: float,
        seed: int = 0) -> tuple[Drafter, float]:
    """A drafter trained on ``data.train``; returns it (eval mode) and the last loss."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    embed, lm_head = data.embed, data.lm_head
    hidden = embed.shape[1]
    drafter = Drafter(hidden, lm_head.shape[0], 2 * hidden, layers, rnn=True)
    with torch.no_grad():
        proj = drafter.lm_head[-1].weight  # [V, 2H]: [context ; state]
        proj.zero_()
        proj[:, :hidden] = lm_head
    final = optimise(drafter.parameters(), windows_loss(drafter, embed, data.train, length, batch_size, gen), steps, lr,
                     "redrafter", clip=1.0)
    return drafter.eval(), final


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train redrafter", __doc__)
    add_common_args(p, steps=1000, lr=3e-3)
    p.add_argument("--batch-size", type=int, default=512, help="positions per step")
    p.add_argument("--length", type=int, default=5, help="levels trained (the longest advised draft_len_per_beam)")
    p.add_argument("--layers", type=int, default=2, help="ResBlocks (num_draft_layers)")
    specs = {f"{m}x{n}": {"num_beams": m, "draft_len_per_beam": n} for m, n in ((4, 4), (1, 4), (5, 5))}
    return run_recipe(argv, p, "redrafter", lambda a, target, tokenizer: train_redrafter(
        target, a.out, tokenizer, steps=a.steps, batch_size=a.batch_size, length=a.length, layers=a.layers, lr=a.lr,
        sequences=a.sequences, gen_len=a.gen_len, seed=a.seed), specs)

if __name__ == "__main__":
    import sys

    sys.exit(main())
