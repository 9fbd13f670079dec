"""``specray train dflash``: a DFlash block drafter distilled from the target (arXiv 2602.06036's
recipe on ``training/base.py``'s data).

Data: the target's greedy continuations of corpus prompts, its final-norm features (its
next-token distributions, through its LM head) and its hidden states after the drafter's
target layers (``target_layer_inputs`` of layers id + 1; by default one per draft layer, spread
over layers 1 .. L - 3 as z-lab's drafters are).

* Random anchors: each step takes ``batch`` sequences and ``anchors`` random positions in each
  one's continuation; every anchor is a block ``[x_a, mask, ..., mask]`` at positions
  a .. a + block - 1 seeing the target's states of the positions before it, all of them in one
  forward (``DFlashDrafter.blocks``: the block mask the drafter is served under, so training
  and inference compute the same thing — tests/test_dflash.py).
* Loss along the block: block position k predicts x_{a+k}; its label is the target's
  distribution there (at ``label_temperature``; 1 is the plain distribution, lower sharpens it
  towards the greedy token), weighted ``exp(-(k - 1) / gamma)`` — early positions matter most,
  a draft being accepted only up to its first miss. The target's embedding and LM head stay
  frozen; the mask token is the tokenizer's pad token (never in the text) unless given.
* Warm start (``--init target``, the default): each draft layer starts from one of the
  target's last layers (its q/k norms at 1), ``norm`` from the target's final norm, ``fc`` reading
  the last tap — a short CPU budget goes further from there; ``random`` is the paper's.

Held out, each anchor's block is drafted as at inference: per block position, the share whose
argmax is the target's own next token, and the accepted length a chain of the whole block
would reach (1 + the leading positions all right), saved with the drafter in z-lab's layout.
"""

from __future__ import annotations

import time

import torch

from specray.policies.dflash import DFlashDrafter, default_layers
from specray.training.base import (
    PromptSource, SequenceSet, add_common_args, distill_data, optimise, recipe_parser, run_recipe, target_layer_inputs,
)


def drafter_config(target: str, draft_layers: int):
    """A Qwen3 layer config of the target's widths (what z-lab's drafters are)."""
    from transformers import AutoConfig, Qwen3Config

    c = AutoConfig.from_pretrained(target)
    rope = getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(c, "rope_theta", 1e4)}
    cfg = Qwen3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                      num_hidden_layers=draft_layers, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
                      max_position_embeddings=c.max_position_embeddings, rope_parameters=dict(rope),
                      hidden_act=getattr(c, "hidden_act", "silu"), attention_bias=False, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def init_from_target(drafter: DFlashDrafter, target: str) -> None:
    """Draft layer i from target layer L - n + i (attention, MLP, norms; q/k norms at 1); the final
    norm the target's; fc passing the last tap through."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    source = model.get_decoder().layers[-len(drafter.layers):]
    hidden = drafter.config.hidden_size
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, source):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(mine.self_attn, name).load_state_dict(getattr(theirs.self_attn, name).state_dict())
            mine.mlp.load_state_dict(theirs.mlp.state_dict())
            mine.input_layernorm.load_state_dict(theirs.input_layernorm.state_dict())
            mine.post_attention_layernorm.load_state_dict(theirs.post_attention_layernorm.state_dict())
        drafter.norm.weight.copy_(model.get_decoder().norm.weight)
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -hidden:] = torch.eye(hidden)


def sample_anchors(data: SequenceSet, batch: int, anchors: int, gen: torch.Generator):
    """``batch`` sequences and ``anchors`` random anchor positions in each one's continuation
    (from its last prompt token, which predicts the first generated one, to its second-to-last
    token): (sequence [b], anchors [b, A]), drawn with replacement."""
    seq = torch.randint(0, len(data.lengths), (batch,), generator=gen)
    lo = (data.prompt_lens[seq] - 1).clamp(min=0)
    hi = (data.lengths[seq] - 2).clamp(min=0)
    span = (hi - lo + 1).clamp(min=1)
    return seq, lo[:, None] + (torch.rand(batch, anchors, generator=gen) * span[:, None]).long()


def block_targets(data: SequenceSet, lm_head: torch.Tensor, seq, anchors, block: int, temperature: float):
    """Labels of every block position k >= 1: the target's distribution of x_{a+k} [b, A, block - 1, V]
    (from its feature at a + k - 1), the tokens themselves [b, A, block - 1] and which exist."""
    n = data.lengths[seq][:, None, None]
    pos = anchors[..., None] + torch.arange(1, block)  # [b, A, block - 1]: the predicted positions
    valid = pos <= n - 1
    pos = torch.minimum(pos, n - 1)
    rows = seq[:, None, None]
    with torch.no_grad():
        p = torch.softmax(data.features[rows, pos - 1] @ lm_head.T / temperature, dim=-1)
    return p, data.tokens[rows, pos], valid


def position_weights(block: int, gamma: float) -> torch.Tensor:
    """exp(-(k - 1) / gamma) for block positions k = 1 .. block - 1 (the paper's decay)."""
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def dflash_loss(drafter: DFlashDrafter, lm_head: torch.Tensor, data: SequenceSet, taps: torch.Tensor, seq, anchors,
                gamma: float, temperature: float) -> torch.Tensor:
    width = int(data.lengths[seq].max())
    hidden = drafter.blocks(taps[seq, :width], data.tokens[seq, :width], anchors)  # [b, A, block, H]
    logq = torch.log_softmax((hidden[:, :, 1:] @ lm_head.T).float(), dim=-1)
    p, _, valid = block_targets(data, lm_head, seq, anchors, drafter.block_size, temperature)
    w = position_weights(drafter.block_size, gamma) * valid  # [b, A, block - 1]
    return (-(p * logq).sum(-1) * w).sum() / w.sum()


@torch.no_grad()
def held_out_blocks(drafter: DFlashDrafter, lm_head: torch.Tensor, data: SequenceSet, taps: torch.Tensor,
                    anchors: int = 32, batch: int = 8) -> dict:
    """Per block position, the share of held-out anchors whose argmax is the target's next token,
    and the accepted length of the whole block as a chain (1 + its leading right positions)."""
    gen = torch.Generator().manual_seed(1)
    block = drafter.block_size
    right, counted, lengths = torch.zeros(block - 1), torch.zeros(block - 1), []
    for _ in range(max(1, len(data.lengths) // batch)):
        seq, where = sample_anchors(data, batch, anchors, gen)
        width = int(data.lengths[seq].max())
        hidden = drafter.blocks(taps[seq, :width], data.tokens[seq, :width], where)
        guess = (hidden[:, :, 1:] @ lm_head.T).argmax(-1)  # [b, A, block - 1]
        _, tokens, valid = block_targets(data, lm_head, seq, where, block, 1.0)
        hit = (guess == tokens) & valid
        right += hit.flatten(0, 1).sum(0)
        counted += valid.flatten(0, 1).sum(0)
        full = valid.all(-1)  # anchors whose whole block has labels
        lengths.append(1 + hit.long().cumprod(-1).sum(-1)[full].float())
    return {"accuracy_per_position": [round(float(r / max(c, 1)), 3) for r, c in zip(right, counted)],
            "chain_accepted_length": round(float(torch.cat(lengths).mean()), 3)}


def default_mask_token(tokenizer: str, vocab: int) -> int:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError):
        return vocab - 1
    return tok.pad_token_id if tok.pad_token_id is not None else vocab - 1


def train_dflash(target: str, out: str, tokenizer: str | None = None, steps: int = 800, lr: float = 3e-3,
                 batch_size: int = 8, anchors: int = 32, block: int = 8, draft_layers: int = 2,
                 layers: tuple[int, ...] | None = None, gamma: float | None = None, label_temperature: float = 1.0,
                 init: str = "target", mask_token: int | None = None, sequences: int = 1024, gen_len: int = 128,
                 seed: int = 0, prompts: PromptSource | None = None) -> dict:
    """Train, measure held-out blocks, save in z-lab's layout; returns a report."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed, prompts)
    num_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    ids = tuple(layers) if layers else default_layers(num_layers, draft_layers)
    cfg = drafter_config(target, draft_layers)
    mask = mask_token if mask_token is not None else default_mask_token(tokenizer or target, cfg.vocab_size)
    gamma = gamma if gamma is not None else max(block / 2, 1.0)
    drafter = DFlashDrafter(cfg, ids, mask, block)
    drafter.check_taps(num_layers)
    taps, held_taps = (target_layer_inputs(target, d, drafter.layer_ids) for d in (data.train, data.held_out))
    if init == "target":
        init_from_target(drafter, target)
    bind_frozen_target(drafter, data, cfg, num_layers)
    data_seconds = time.time() - start
    before = held_out_blocks(drafter.eval(), data.lm_head, data.held_out, held_taps)
    drafter.train()
    final = optimise(drafter.parameters(), lambda step: dflash_loss(
        drafter, data.lm_head, data.train, taps, *sample_anchors(data.train, batch_size, anchors, gen), gamma,
        label_temperature), steps, lr, "dflash drafter", clip=1.0)
    drafter.eval()
    after = held_out_blocks(drafter, data.lm_head, data.held_out, held_taps)
    drafter.save(out, num_target_layers=num_layers)
    return {"dflash_dir": out, "steps": steps, "block_size": block, "draft_layers": draft_layers,
            "target_layer_ids": list(ids), "gamma": gamma, "label_temperature": label_temperature, "init": init,
            "mask_token": mask, "final_loss": round(final, 4), "held_out_before": before, "held_out": after,
            "data_seconds": round(data_seconds, 1), "seconds": round(time.time() - start, 1)}


EVAL_SPECS = {"block": {}, "k=4": {"num_speculative_tokens": 4}}


def bind_frozen_target(drafter, data, cfg, num_layers: int) -> None:
    """The target's embedding and LM head, shared with the drafter and frozen (the recipes')."""
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    head.weight = torch.nn.Parameter(data.lm_head, requires_grad=False)
    drafter.bind(torch.nn.Embedding.from_pretrained(data.embed, freeze=True), head, num_layers)


def add_block_args(p) -> None:
    """The block drafters' options (DFlash's and DSpark's recipes)."""
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    p.add_argument("--block", type=int, default=8, help="block size")
    p.add_argument("--draft-layers", type=int, default=2, help="the drafter's layers")
    p.add_argument("--layers", default=None, help="target layers whose outputs it reads, e.g. 1,9 "
                                                   "(default: one per draft layer over 1 .. L - 3)")
    p.add_argument("--gamma", type=float, default=None, help="loss weight exp(-(k - 1) / gamma) along the block "
                                                              "(default: block / 2)")
    p.add_argument("--label-temperature", type=float, default=1.0, help="temperature of the target's distribution "
                                                                        "as the label")
    p.add_argument("--init", choices=("target", "random"), default="target",
                   help="the drafter's layers start from the target's or at random")
    p.add_argument("--mask-token", type=int, default=None, help="the mask token id (default: the tokenizer's pad)")


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train dflash", __doc__)
    add_common_args(p, steps=800, lr=3e-3)
    add_block_args(p)

    def train(a, target, tokenizer):
        layers = tuple(int(k) for k in a.layers.split(",")) if a.layers else None
        return train_dflash(target, a.out, tokenizer, steps=a.steps, lr=a.lr, batch_size=a.batch_size,
                            anchors=a.anchors, block=a.block, draft_layers=a.draft_layers, layers=layers,
                            gamma=a.gamma, label_temperature=a.label_temperature, init=a.init,
                            mask_token=a.mask_token, sequences=a.sequences, gen_len=a.gen_len, seed=a.seed)

    return run_recipe(argv, p, "dflash", train, EVAL_SPECS)


if __name__ == "__main__":
    import sys

    sys.exit(main())
