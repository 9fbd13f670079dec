"""``specray train draft``: the draft model distilled from the target's distribution (OSD).

Online Speculative Decoding (Liu et al., ICML 2024) distils the draft model on the queries it
served, with the target's distribution at every position the target verified as the teacher.
Here the teacher is the target's top-k log-probabilities there (k <= 20, so a position costs
2k numbers, not a vocabulary), renormalised over those k at the temperature the request drew
its tokens at; the loss is the forward KL to it, -sum_i p_i log q(i) over the teacher's k
tokens, with the draft reading the target's own tokens (teacher forcing). The draft then puts
its mass where the target does — what acceptance rewards, sampled (min(1, p/q)) and greedy
(the argmax is the teacher's first token).

Greedy requests draw at temperature 0, whose distribution is one-hot on the target's token; the
teacher for them is the target's distribution sharpened to ``greedy_temperature`` instead
(default 0.25), which keeps the ranking below the top token as a soft label. On the shifted
workload of ``python -m specray.bench.online --methods draft --greedy-temperature T`` it trained
a better greedy drafter than the raw distribution (T = 1) or the one-hot (T = 0):
``docs/online-learning.md``, Measured.

The same loss serves online learning (``training/online.py``: traces captured from served
requests, ``engine/capture.py``) and this command, which builds the teacher offline from the
target's greedy continuations of corpus prompts (``training/base.py``: the final-norm features
through the LM head give the target's logits) and starts from the configured draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specray.engine.runner import final_softcap, head_logits
from specray.training.base import add_common_args, recipe_parser, distill_data, optimise, run_recipe

GREEDY_TEMPERATURE = 0.25  # the teacher's temperature for greedy requests' tokens (see the module doc)


@dataclass
class TeacherSet:
    """Sequences with the target's top-k at their continuation positions.

    tokens:  [N, T] int64 right-padded; lengths: [N]; prompt_lens: [N]
    top_ids: [N, T, k] int64 at position t, the target's k best next tokens (positions
             prompt_len - 1 .. length - 2; elsewhere unused); top_lp: [N, T, k] their log-probabilities
    valid:   [N, T] bool the positions with a teacher
    temperature: [N] float32 the teacher's temperature per sequence (0: the top token only)
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lens: torch.Tensor
    top_ids: torch.Tensor
    top_lp: torch.Tensor
    valid: torch.Tensor
    temperature: torch.Tensor

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], int, torch.Tensor, torch.Tensor]],
                  temperatures: list[float] | None = None) -> "TeacherSet":
        """rows: (tokens [L], prompt length P, top ids [L - P, k], top log-probs [L - P, k]);
        temperatures: the teacher's per row (default 1: the target's distribution as it is)."""
        width, k = max(len(r[0]) for r in rows), rows[0][2].shape[1]
        n = len(rows)
        tokens = torch.zeros(n, width, dtype=torch.long)
        ids = torch.zeros(n, width, k, dtype=torch.long)
        lp = torch.full((n, width, k), -1e4)
        valid = torch.zeros(n, width, dtype=torch.bool)
        for i, (toks, p, top_ids, top_lp) in enumerate(rows):
            m = min(len(toks) - p, top_ids.shape[0])
            tokens[i, : len(toks)] = torch.tensor(toks)
            ids[i, p - 1 : p - 1 + m] = top_ids[:m]
            lp[i, p - 1 : p - 1 + m] = top_lp[:m].float()
            valid[i, p - 1 : p - 1 + m] = True
        valid[:, -1] = False  # the last position's next token is never read
        temps = torch.tensor(temperatures if temperatures is not None else [1.0] * n, dtype=torch.float32)
        return cls(tokens, torch.tensor([len(r[0]) for r in rows]), torch.tensor([r[1] for r in rows]), ids, lp, valid,
                   temps)


def teacher_temperature(request_temperature: float, greedy_temperature: float = GREEDY_TEMPERATURE) -> float:
    """The teacher's temperature for tokens drawn at ``request_temperature`` (0: greedy)."""
    return request_temperature if request_temperature > 0 else greedy_temperature


def osd_loss(model, data: TeacherSet, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    """Forward KL from the teacher's renormalised top-k (at each sequence's temperature) to the
    draft, on ``batch_size`` sequences."""
    seq = torch.randint(0, len(data.lengths), (batch_size,), generator=gen)
    width = int(data.lengths[seq].max())
    valid = data.valid[seq, :width]
    logq = torch.log_softmax(logits_where(model, data.tokens[seq, :width], valid), dim=-1)  # [P, V]
    temps = data.temperature[seq, None].expand(-1, width)[valid]  # [P]
    p = teacher(data.top_lp[seq, :width][valid], temps)  # [P, k]
    return -(p * logq.gather(1, data.top_ids[seq, :width][valid])).sum(-1).mean()


def logits_where(model, input_ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """[P, V] float32 logits of a causal LM at the positions ``where`` ([B, T] bool) selects:
    the decoder over every position, the LM head only where a loss reads it (a small draft's
    largest matmul: its vocabulary; prompt and padding positions have no teacher), as the
    engine's runner computes them (``head_logits``)."""
    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state  # [B, T, H]
    return head_logits(model.get_output_embeddings(), hidden[where], final_softcap(model.config))


def teacher(top_lp: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[..., k] log-probabilities (best first) and temperatures [...] -> the teacher's
    distribution over those k tokens (temperature 0: all mass on the first, the greedy token)."""
    hard = temperature <= 0
    soft = torch.softmax(top_lp / torch.where(hard, 1.0, temperature)[..., None], dim=-1)
    one_hot = torch.zeros_like(top_lp)
    one_hot[..., 0] = 1.0
    return torch.where(hard[..., None], one_hot, soft)


@torch.no_grad()
def greedy_agreement(model, data: TeacherSet) -> float:
    """Share of teacher positions where the draft's argmax is the target's."""
    logits = model(input_ids=data.tokens).logits
    return (logits.argmax(-1)[data.valid] == data.top_ids[..., 0][data.valid]).float().mean().item()


def train_draft(target: str, draft: str, out: str, tokenizer: str | None = None, steps: int = 300, lr: float = 1e-3,
                batch_size: int = 16, top_k: int = 20, sequences: int = 512, gen_len: int = 128, seed: int = 0,
                teacher_temperature: float = 1.0) -> dict:
    """Distil ``draft`` on the target's greedy continuations of corpus prompts (the teacher at
    ``teacher_temperature``); save it to ``out``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed)

    def teacher_set(split) -> TeacherSet:
        rows = []
        for i in range(len(split.lengths)):
            n, p = int(split.lengths[i]), int(split.prompt_lens[i])
            lp = torch.log_softmax(split.features[i, p - 1 : n - 1] @ data.lm_head.T, dim=-1)
            top_lp, top_ids = lp.topk(top_k, dim=-1)
            rows.append((split.tokens[i, :n].tolist(), p, top_ids, top_lp))
        return TeacherSet.from_rows(rows, [teacher_temperature] * len(rows))

    train, held_out = teacher_set(data.train), teacher_set(data.held_out)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    before = greedy_agreement(model.eval(), held_out)
    model.train()
    final = optimise(model.parameters(), lambda step: osd_loss(model, train, batch_size, gen), steps, lr,
                     "draft (OSD)", clip=1.0)
    model.eval()
    model.save_pretrained(out)
    return {"draft_dir": out, "steps": steps, "final_loss": round(final, 4), "top_k": top_k,
            "held_out_agreement_before": round(before, 3), "held_out_agreement": round(greedy_agreement(model, held_out), 3),
            "seconds": round(time.time() - start, 1)}


EVAL_SPECS = {"k=4": {"num_speculative_tokens": 4}}


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train draft", __doc__)
    add_common_args(p, steps=300, lr=1e-3)
    p.add_argument("--draft", default=None, help="the draft to start from (default: the demo draft)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    p.add_argument("--top-k", type=int, default=20, help="teacher tokens per position (at most 20)")
    p.add_argument("--teacher-temperature", type=float, default=1.0,
                   help="the teacher's temperature (1: the target's distribution; 0: its greedy token only)")

    def train(a, target, tokenizer):
        draft = a.draft
        if draft is None:
            from specray.demo import load_or_build_demo_pair

            draft = load_or_build_demo_pair().draft
        return train_draft(target, draft, a.out, tokenizer, steps=a.steps, lr=a.lr, batch_size=a.batch_size,
                           top_k=min(a.top_k, 20), sequences=a.sequences, gen_len=a.gen_len, seed=a.seed,
                           teacher_temperature=a.teacher_temperature)

    return run_recipe(argv, p, "draft", train, EVAL_SPECS)


if __name__ == "__main__":
    import sys

    sys.exit(main())
