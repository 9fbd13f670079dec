"""``specray train dspark``: a DSpark drafter — DFlash's backbone, a Markov head and a confidence
head — distilled from the target (arXiv 2607.05147's recipe on ``training/base.py``'s data).

Data and anchors are DFlash's (``training/dflash.py``): random anchors in the target's greedy
continuations, every anchor's block ``[x_a, mask, ...]`` in one forward seeing the target's taps
before it. With ``sample_from_anchor`` (the default) block slot k predicts x_{a+k+1} (the root's
slot drafts too), else slot k >= 1 predicts x_{a+k}. Per slot:

* the Markov head's bias from the true previous token (teacher forcing: on the accepted prefix,
  where a draft matters, the drafted previous token is the true one);
* loss ``0.1 CE + 0.9 TV`` against the target's distribution there (CE to its distribution at
  ``label_temperature``; TV = total variation between the drafter's and the target's), plus the
  confidence head's BCE against 1 - TV (the probability a token drawn from the draft is accepted,
  detached), every term weighted ``exp(-(k - 1) / gamma)`` along the block (k = 1 the first draft);
* the target's embedding and LM head shared and frozen; the backbone starts from the target's
  last layers (as DFlash's does) or from a trained DFlash drafter (``--init-from DIR``), the
  Markov head's projection at zero (so training starts from the backbone's drafts).

Held out, per draft slot: the share right given every earlier slot was (what a chain accepts),
the confidence head's mean estimate there, and the whole block's accepted length as a chain;
with the Markov head and without it (the same backbone). Saved in vLLM speculators' layout.
"""

from __future__ import annotations

import contextlib
import time

import torch

from specray.policies.dflash import DFlashDrafter, default_layers
from specray.policies.dspark import DSparkDrafter
from specray.training.base import (
    PromptSource, SequenceSet, add_common_args, distill_data, optimise, recipe_parser, run_recipe, target_layer_inputs,
)
from specray.training.dflash import (
    add_block_args, bind_frozen_target, block_targets, default_mask_token, drafter_config, init_from_target, position_weights, sample_anchors,
)

CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0


def slot_targets(drafter: DSparkDrafter, data: SequenceSet, lm_head: torch.Tensor, seq, anchors, temperature: float):
    """Per draft slot: the target's distribution [b, A, D, V], the true token [b, A, D], the true
    previous token [b, A, D], which exist [b, A, D] (D = the block's drafts)."""
    first, size = drafter.first_draft, drafter.block_size
    # slot k predicts position a + k + 1 - first: DFlash's labels of a block one longer (with the anchor)
    p, tokens, valid = block_targets(data, lm_head, seq, anchors, size + 1 - first, temperature)
    roots = data.tokens[seq[:, None], anchors]  # [b, A]
    prev = torch.cat([roots[..., None], tokens[..., :-1]], dim=-1)
    return p, tokens, prev, valid


def dspark_terms(drafter: DSparkDrafter, lm_head: torch.Tensor, data: SequenceSet, taps: torch.Tensor, seq, anchors,
                 temperature: float):
    """(draft logits [b, A, D, V], confidence logits or None, labels p, true tokens, valid);
    ``lm_head`` [V, H]: the target's."""
    width = int(data.lengths[seq].max())
    hidden = drafter.blocks(taps[seq, :width], data.tokens[seq, :width], anchors)[:, :, drafter.first_draft:]
    p, tokens, prev, valid = slot_targets(drafter, data, lm_head, seq, anchors, temperature)
    logits, conf = drafter.teacher_forced(hidden, prev)
    return logits, conf, p, tokens, valid


def dspark_loss(drafter: DSparkDrafter, lm_head: torch.Tensor, data: SequenceSet, taps: torch.Tensor, seq, anchors,
                gamma: float, temperature: float) -> torch.Tensor:
    logits, conf, p, _, valid = dspark_terms(drafter, lm_head, data, taps, seq, anchors, temperature)
    logq = torch.log_softmax(logits, dim=-1)
    tv = 0.5 * (logq.exp() - p).abs().sum(-1)  # [b, A, D]
    per_slot = CE_WEIGHT * -(p * logq).sum(-1) + TV_WEIGHT * tv
    if conf is not None:
        per_slot = per_slot + CONFIDENCE_WEIGHT * torch.nn.functional.binary_cross_entropy_with_logits(
            conf.float(), (1 - tv).detach().clamp(0, 1), reduction="none")
    w = position_weights(logits.shape[2] + 1, gamma) * valid
    return (per_slot * w).sum() / w.sum()


@contextlib.contextmanager
def backbone_only(drafter: DSparkDrafter):
    """The drafter without its Markov and confidence heads (the same backbone's own drafts)."""
    heads = drafter.markov_head, drafter.confidence_head
    drafter.markov_head = drafter.confidence_head = None
    try:
        yield drafter
    finally:
        drafter.markov_head, drafter.confidence_head = heads


@torch.no_grad()
def held_out_slots(drafter: DSparkDrafter, lm_head: torch.Tensor, data: SequenceSet, taps: torch.Tensor, anchors: int = 32,
                   batch: int = 8) -> dict:
    """Greedy, per draft slot: acceptance given the earlier slots were accepted (with and
    without the Markov head), the confidence head's mean estimate over the same slots, and the
    block's accepted length as a chain."""
    gen = torch.Generator().manual_seed(1)
    parts: dict[str, list] = {"markov": [], "backbone": []}
    for _ in range(max(1, len(data.lengths) // batch)):
        seq, where = sample_anchors(data, batch, anchors, gen)
        runs = [("markov", drafter)]
        if drafter.markov_head is not None:
            runs.append(("backbone", None))
        for name, _ in runs:
            if name == "backbone":
                with backbone_only(drafter):
                    logits, conf, _, tokens, valid = dspark_terms(drafter, lm_head, data, taps, seq, where, 1.0)
            else:
                logits, conf, _, tokens, valid = dspark_terms(drafter, lm_head, data, taps, seq, where, 1.0)
            hit = (logits.argmax(-1) == tokens) & valid
            full = valid.all(-1)  # anchors whose whole block has labels
            reached = torch.cat([torch.ones_like(hit[..., :1]), hit.cumprod(-1)[..., :-1].bool()], -1)
            parts[name].append((reached[full].float(), hit[full].float(),
                                None if conf is None else torch.sigmoid(conf.float())[full]))
    out = {}
    for name, got in parts.items():
        if not got:
            continue
        reached, hit = torch.cat([r for r, _, _ in got]), torch.cat([h for _, h, _ in got])
        count = reached.sum(0).clamp(min=1)
        out[name] = {"acceptance_per_slot": [round(float(a), 3) for a in (hit * reached).sum(0) / count],
                     "chain_accepted_length": round(float(1 + (hit * reached).sum(-1).mean()), 3)}
        if got[0][2] is not None:
            conf = torch.cat([c for _, _, c in got])
            out[name]["confidence_per_slot"] = [round(float(c), 3) for c in (conf * reached).sum(0) / count]
    return out


def train_dspark(target: str, out: str, tokenizer: str | None = None, steps: int = 800, lr: float = 3e-3,
                 batch_size: int = 8, anchors: int = 32, block: int = 8, draft_layers: int = 2,
                 layers: tuple[int, ...] | None = None, gamma: float | None = None, label_temperature: float = 1.0,
                 init: str = "target", init_from: str | None = None, mask_token: int | None = None,
                 markov_rank: int = 64, markov_head_type: str = "vanilla", confidence: bool = True,
                 confidence_with_markov: bool = True, sample_from_anchor: bool = True, sequences: int = 1024,
                 gen_len: int = 128, seed: int = 0, prompts: PromptSource | None = None) -> dict:
    """Train, measure held-out blocks, save in speculators' layout; returns a report. ``layers``:
    the target layers whose outputs it reads (DFlash's spelling; default one per draft layer over
    1 .. L - 3)."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed, prompts)
    num_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    base = DFlashDrafter.load(init_from) if init_from else None
    if base is not None:
        block, layers, mask_token = base.block_size, base.target_layer_ids, base.mask_token_id
        cfg = base.config
    else:
        cfg = drafter_config(target, draft_layers)
    ids = tuple(layers) if layers else default_layers(num_layers, draft_layers)
    mask = mask_token if mask_token is not None else default_mask_token(tokenizer or target, cfg.vocab_size)
    gamma = gamma if gamma is not None else max(block / 2, 1.0)
    drafter = DSparkDrafter(cfg, [k + 1 for k in ids], mask, block, markov_rank, markov_head_type, confidence,
                            confidence_with_markov and markov_rank > 0, sample_from_anchor)
    drafter.check_taps(num_layers)
    if base is not None:
        drafter.load_state_dict(base.state_dict(), strict=False)
    elif init == "target":
        init_from_target(drafter, target)
    if drafter.markov_head is not None:
        torch.nn.init.zeros_(drafter.markov_head.markov_w2.weight)
    taps, held_taps = (target_layer_inputs(target, d, drafter.layer_ids) for d in (data.train, data.held_out))
    bind_frozen_target(drafter, data, cfg, num_layers)
    data_seconds = time.time() - start
    before = held_out_slots(drafter.eval(), data.lm_head, data.held_out, held_taps)
    drafter.train()
    final = optimise(drafter.parameters(), lambda step: dspark_loss(
        drafter, data.lm_head, data.train, taps, *sample_anchors(data.train, batch_size, anchors, gen), gamma, label_temperature),
        steps, lr, "dspark drafter", clip=1.0)
    drafter.eval()
    after = held_out_slots(drafter, data.lm_head, data.held_out, held_taps)
    drafter.save(out, num_target_layers=num_layers, verifier=target)
    return {"dspark_dir": out, "steps": steps, "block_size": block, "draft_layers": len(drafter.layers),
            "aux_hidden_state_layer_ids": list(drafter.layer_ids), "markov_rank": markov_rank,
            "markov_head_type": markov_head_type, "confidence_head": confidence,
            "sample_from_anchor": sample_from_anchor, "gamma": gamma, "init": init_from or init, "mask_token": mask,
            "final_loss": round(final, 4), "held_out_before": before, "held_out": after,
            "data_seconds": round(data_seconds, 1), "seconds": round(time.time() - start, 1)}


EVAL_SPECS = {"block": {}, "k=4": {"num_speculative_tokens": 4}}


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train dspark", __doc__)
    add_common_args(p, steps=800, lr=3e-3)
    add_block_args(p)
    p.add_argument("--init-from", default=None, metavar="DFLASH_DIR",
                   help="start the backbone from a trained DFlash drafter (its block, taps and mask token; "
                        "default: as --init says)")
    p.add_argument("--markov-rank", type=int, default=64, help="the Markov head's rank (0: none, plain DFlash)")
    p.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default="vanilla",
                   help="the bias from the previous token's embedding alone, gated by the backbone state, or a "
                        "recurrent state over the block")
    p.add_argument("--no-confidence-head", action="store_true", help="train no confidence head")
    p.add_argument("--confidence-without-markov", action="store_true",
                   help="the confidence head reads the backbone state only")
    p.add_argument("--no-sample-from-anchor", action="store_true",
                   help="the root's slot drafts nothing (DFlash's convention: block - 1 drafts)")

    def train(a, target, tokenizer):
        layers = tuple(int(k) for k in a.layers.split(",")) if a.layers else None
        return train_dspark(target, a.out, tokenizer, steps=a.steps, lr=a.lr, batch_size=a.batch_size,
                            anchors=a.anchors, block=a.block, draft_layers=a.draft_layers, layers=layers,
                            gamma=a.gamma, label_temperature=a.label_temperature, init=a.init, init_from=a.init_from,
                            mask_token=a.mask_token, markov_rank=a.markov_rank, markov_head_type=a.markov_head_type,
                            confidence=not a.no_confidence_head,
                            confidence_with_markov=not a.confidence_without_markov,
                            sample_from_anchor=not a.no_sample_from_anchor, sequences=a.sequences,
                            gen_len=a.gen_len, seed=a.seed)

    return run_recipe(argv, p, "dspark", train, EVAL_SPECS)


if __name__ == "__main__":
    import sys

    sys.exit(main())
