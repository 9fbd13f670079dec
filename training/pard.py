"""``specray train pard``: a parallel draft model (PARD) adapted from a draft model by
conditional drop-token (COD) training.

PARD (An et al., ICLR 2026) teaches a small causal LM to read k - 1 mask tokens after the
committed ones and predict, at each, the token one place further on. A window of L positions
becomes K copies in one sequence: copy 0 is the text itself (next-token prediction, as before),
copy j holds mask tokens, and its entry at position t predicts x_{t+1} seeing the real tokens
up to t - j and copy i's entry at t - (j - i) for 0 < i < j — exactly the j-th mask after root
x_{t-j} at inference (``policies/pard.py``). Copy 0 spans the whole prefix, not only the window,
so every mask sees the context it will see at inference (a model adapted on windows cut out of
their text forgets how to draft after a long prompt), and position ids are the sequence's own.
Plain masked training keeps all K copies of the window (K x L entries); COD keeps copy j's at a
random share max(r^j, r_min) of the positions, only where copy j - 1 kept the position before
(an entry's masks before it must exist): about 2.4L mask entries for K = 8, r = 0.7,
r_min = 0.2 instead of 7L (AMD's ``down_sample_ration`` and ``down_sample_ration_min``; their
default r, r_min and K = 8). The loss covers the window's entries, copy 0's and the masks'.

Labels: the target's next-token distribution at each position (the demo target's greedy
continuations of corpus prompts, ``training/base.py``; its final-norm features through its LM
head): the draft then puts its mass where the target does, as the draft model's own recipe
(``training/draft_distill.py``) teaches it; ``--hard-labels`` uses the tokens instead (AMD's
recipe, which needs no target). The mask token defaults to the tokenizer's pad token (never
in the text); it is saved as ``pard_token`` in config.json with ``spd_type: pard`` (AMD's keys)
and specray's ``pard_max_tokens`` = K.

Held out, every position j of every window is scored with all K copies kept: the share of
positions where the draft's argmax is the target's own next token, per mask depth (position 1
is the plain next-token prediction), before and after.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specray.training.base import SequenceSet, add_common_args, distill_data, optimise, recipe_parser, run_recipe


def cod_layout(length: int, copies: int, keep: float, keep_min: float, gen: torch.Generator | None):
    """Which (copy, position) entries a window of ``length`` keeps: copy 0 whole, copy j a random
    ``max(keep ** j, keep_min)`` share of the positions whose entry in copy j - 1 is kept one
    place before. Returns (copy [N], position [N]) int64, copy by copy."""
    copy_ids, positions = [torch.zeros(length, dtype=torch.long)], [torch.arange(length)]
    previous = torch.arange(length)
    for j in range(1, copies):
        allowed = previous + 1
        allowed = allowed[allowed < length]
        n = min(len(allowed), int(length * max(keep ** j, keep_min)))
        if n == 0:
            break
        chosen = allowed[torch.randperm(len(allowed), generator=gen)[:n]].sort().values
        copy_ids.append(torch.full((n,), j, dtype=torch.long))
        positions.append(chosen)
        previous = chosen
    return torch.cat(copy_ids), torch.cat(positions)


def cod_mask(copy: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[N, N] bool: entry (j, t) sees (0, s) for s <= t - j and (i, t - (j - i)) for 0 < i <= j."""
    jq, tq, jk, tk = copy[:, None], pos[:, None], copy[None, :], pos[None, :]
    return ((jk == 0) & (tk <= tq - jq)) | ((jk >= 1) & (jk <= jq) & (tk == tq - (jq - jk)))


def _additive(mask: torch.Tensor) -> torch.Tensor:  # [N, N] bool -> [1, 1, N, N] float
    return torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]


def sequence_layout(length: int, start: int, width: int, copies: int, keep: float, keep_min: float,
                    gen: torch.Generator | None):
    """The entries of a batch of sequences ``length`` long: copy 0 at every position (the whole
    prefix, so that masks see the context they will see at inference), copies j >= 1 by COD over
    the window [start, start + width). (copy [N], position [N])."""
    copy, pos = cod_layout(width, copies, keep, keep_min, gen)
    masks = copy > 0
    return (torch.cat([torch.zeros(length, dtype=torch.long), copy[masks]]),
            torch.cat([torch.arange(length), pos[masks] + start]))


def sample_window(data: SequenceSet, batch: int, width: int, gen: torch.Generator):
    """``batch`` sequences, their common padded length and a window start inside the continuations."""
    seq = torch.randint(0, len(data.lengths), (batch,), generator=gen)
    length = int(data.lengths[seq].max())
    lo = max(int(data.prompt_lens[seq].min()) - 1, 0)
    hi = max(lo, length - width)
    return seq, length, lo + int(torch.randint(0, hi - lo + 1, (1,), generator=gen))


def _forward(model, data: SequenceSet, seq, layout, mask_token: int):
    """Logits [B, N, V] of every entry of ``layout`` over sequences ``seq`` (right-padded)."""
    copy, pos = layout
    tokens = data.tokens[seq][:, pos]  # [B, N]
    ids = torch.where(copy[None] == 0, tokens, torch.full_like(tokens, mask_token))
    attention = _additive(cod_mask(copy, pos)).expand(len(seq), -1, -1, -1)
    return model(input_ids=ids, position_ids=pos[None].expand(len(seq), -1), attention_mask=attention).logits


def pard_loss(model, data: SequenceSet, lm_head: torch.Tensor, seq, layout, start: int, width: int,
              mask_token: int, hard_labels: bool = False) -> torch.Tensor:
    """Cross-entropy of the window's entries (copy 0 and the masks, AMD's loss) against their
    labels: the target's distribution of x_{t+1} (or the token itself with ``hard_labels``)."""
    copy, pos = layout
    logits = _forward(model, data, seq, layout, mask_token)
    n = data.lengths[seq][:, None]
    keep = (pos[None] + 1 < n) & (pos[None] >= start) & (pos[None] < start + width)  # [B, N]
    rows = seq[:, None].expand_as(keep)[keep]
    at = pos[None].expand_as(keep)[keep]
    logq = torch.log_softmax(logits[keep].float(), dim=-1)  # [P, V]
    if hard_labels:
        return F.nll_loss(logq, data.tokens[rows, at + 1])
    with torch.no_grad():
        p = torch.softmax(data.features[rows, at] @ lm_head.T, dim=-1)  # [P, V]
    return -(p * logq).sum(-1).mean()


@torch.no_grad()
def position_accuracy(model, data: SequenceSet, copies: int, mask_token: int, width: int = 64,
                      batch: int = 8) -> list[float]:
    """Per draft position (1 = the last committed token's own prediction, j + 1 = the j-th
    mask's), the share of held-out continuation positions where the argmax is the target's
    next token (its greedy continuation's), every copy kept, each with its whole prefix."""
    hit, total = torch.zeros(copies), torch.zeros(copies)
    gen = torch.Generator().manual_seed(0)
    for _ in range(max(1, len(data.lengths) // batch)):
        seq, length, start = sample_window(data, batch, width, gen)
        copy, pos = layout = sequence_layout(length, start, min(width, length - start), copies, 1.0, 1.0, None)
        right = _forward(model, data, seq, layout, mask_token).argmax(-1) == data.tokens[seq][:, (pos + 1).clamp(
            max=data.tokens.shape[1] - 1)]  # [B, N]
        n, prompt = data.lengths[seq][:, None], data.prompt_lens[seq][:, None]
        counted = (pos[None] + 1 < n) & (pos[None] >= prompt - 1) & (pos[None] >= start)
        for j in range(copies):
            at = counted & (copy[None] == j)
            hit[j] += (right & at).sum()
            total[j] += at.sum()
    return [round(float(h / max(n, 1)), 3) for h, n in zip(hit, total)]


def default_mask_token(tokenizer: str) -> int:
    """The tokenizer's pad token (never in the text), else its last id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return tok.pad_token_id if tok.pad_token_id is not None else len(tok) - 1


def train_pard(target: str, draft: str, out: str, tokenizer: str | None = None, steps: int = 600, lr: float = 1e-3,
               batch_size: int = 8, width: int = 64, copies: int = 8, keep: float = 0.7, keep_min: float = 0.2,
               hard_labels: bool = False, mask_token: int | None = None, sequences: int = 1024, gen_len: int = 128,
               seed: int = 0, prompts=None) -> dict:
    """COD-train ``draft`` into a PARD model drafting up to ``copies`` tokens; save it to ``out``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed, prompts)
    mask = mask_token if mask_token is not None else default_mask_token(tokenizer or target)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32, attn_implementation="sdpa")
    if not 0 <= mask < model.config.vocab_size:
        raise ValueError(f"mask token {mask} is outside the draft's vocabulary of {model.config.vocab_size}")
    before = position_accuracy(model.eval(), data.held_out, copies, mask)
    data_seconds = time.time() - start
    model.train()
    def loss_at(step: int) -> torch.Tensor:
        seq, length, start = sample_window(data.train, batch_size, width, gen)
        span = min(width, length - start)
        layout = sequence_layout(length, start, span, copies, keep, keep_min, gen)
        return pard_loss(model, data.train, data.lm_head, seq, layout, start, span, mask, hard_labels)

    final = optimise(model.parameters(), loss_at, steps, lr, "pard (COD)", clip=1.0)
    model.eval()
    after = position_accuracy(model, data.held_out, copies, mask)
    model.config.pard_token, model.config.spd_type, model.config.pard_max_tokens = mask, "pard", copies
    model.save_pretrained(out)
    return {"pard_dir": out, "steps": steps, "copies": copies, "keep": keep, "keep_min": keep_min,
            "mask_token": mask, "final_loss": round(final, 4), "held_out_accuracy_per_position_before": before,
            "held_out_accuracy_per_position": after, "data_seconds": round(data_seconds, 1),
            "seconds": round(time.time() - start, 1)}


EVAL_SPECS = {"k=4": {"num_speculative_tokens": 4}, "k=6": {"num_speculative_tokens": 6},
              "self-tuned": {}}


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train pard", __doc__)
    add_common_args(p, steps=600, lr=1e-3)
    p.add_argument("--draft", default=None, help="the draft model to adapt (default: the demo draft)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--width", type=int, default=64, help="positions of the window the masks cover (L)")
    p.add_argument("--copies", type=int, default=8, help="K: the most tokens the model will draft per forward")
    p.add_argument("--keep", type=float, default=0.7, help="COD: copy j keeps max(keep^j, keep-min) of the positions")
    p.add_argument("--keep-min", type=float, default=0.2, help="COD: the least share of positions a copy keeps")
    p.add_argument("--hard-labels", action="store_true", help="the tokens as labels (AMD's recipe), not the target's "
                                                              "distribution")
    p.add_argument("--mask-token", type=int, default=None, help="the mask token id (default: the tokenizer's pad)")

    def train(a, target, tokenizer):
        draft = a.draft
        if draft is None:
            from specray.demo import load_or_build_demo_pair

            draft = load_or_build_demo_pair().draft
        return train_pard(target, draft, a.out, tokenizer, steps=a.steps, lr=a.lr, batch_size=a.batch_size,
                          width=a.width, copies=a.copies, keep=a.keep, keep_min=a.keep_min, hard_labels=a.hard_labels,
                          mask_token=a.mask_token, sequences=a.sequences, gen_len=a.gen_len, seed=a.seed)

    return run_recipe(argv, p, "pard", train, EVAL_SPECS)


if __name__ == "__main__":
    import sys

    sys.exit(main())
