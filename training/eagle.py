"""``specray train eagle``: an EAGLE head distilled from the target's own features.

Data from ``training/base.py`` (greedy continuations, cached final-norm features). The head
reads pairs (f_t, x_{t+1}) over windows of each sequence and learns, at every position,
the target's next feature f_{t+1} (smooth L1) and the target's next-token distribution
softmax(lm_head(f_{t+1})) through the frozen LM head (cross-entropy), with uniform noise
on the input features (EAGLE's recipe; the noise stands in for the head's own errors
when it drafts on its predicted features). The layer starts from the target's last
decoder layer.

Held out, the head drafts along the true continuation on its *own* features, as at
inference (``chain_ranks``): the per-depth ranks of the true tokens give the k-step
accuracies and the fitted default tree (``training.fit_tree``), saved in ``config.json`` as
``eagle_choices``. The result uses the public EAGLE layout.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.nn.functional as F

from specray.training.base import (
    PromptSource, SequenceSet, add_common_args, recipe_parser, distill_data, fit_tree, optimise, ranks_of, run_recipe,
)
from specray.policies.eagle import EagleHead


def head_config(target: str):
    """A one-layer Llama config shaped like the target's layers."""
    from transformers import AutoConfig, LlamaConfig

    cfg = AutoConfig.from_pretrained(target)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "vocab_size", "rope_parameters", "hidden_act")
    return LlamaConfig(**{k: getattr(cfg, k) for k in keys if getattr(cfg, k, None) is not None},
                       num_hidden_layers=1, tie_word_embeddings=False)


class _Frozen(torch.nn.Module):
    """The target's embedding / LM head for training (weights only, frozen)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return F.embedding(x, self.weight)


def windows(data: SequenceSet, batch: int, width: int, gen: torch.Generator):
    """``batch`` windows of ``width`` pairs ending inside each sequence's continuation:
    (tokens x_{t+1} [B, W], features f_t [B, W, H], next features f_{t+1} [B, W, H], valid [B, W])."""
    seq = torch.randint(0, len(data.lengths), (batch,), generator=gen)
    lengths, prompt = data.lengths[seq], data.prompt_lens[seq]
    # the window's last pair (f_t, x_{t+1}) needs f_{t+1}: t <= n - 2
    hi = lengths - 1 - width
    lo = torch.clamp(prompt - width // 2, min=0)
    start = torch.minimum(lo + (torch.rand(batch, generator=gen) * (hi - lo + 1).clamp(min=1)).long(), hi.clamp(min=0))
    t = start[:, None] + torch.arange(width)  # [B, W]
    valid = t < (lengths - 1)[:, None]
    t = torch.minimum(t, (lengths - 2)[:, None])
    rows = seq[:, None].expand_as(t)
    return data.tokens[rows, t + 1], data.features[rows, t], data.features[rows, t + 1], valid


def eagle_loss(head: EagleHead, lm_head: torch.Tensor, batch, noise: float, token_weight: float,
               unroll: int = 1) -> torch.Tensor:
    """EAGLE's loss; with ``unroll`` > 1 also on passes that read the head's own predicted
    features instead of the target's (each pass's input feature at t is the previous pass's
    prediction of f_t), weighted 1/2, 1/4, ...: it drafts on its own features at inference."""
    tokens, feats, target, valid = batch
    if noise:
        feats = feats + (torch.rand_like(feats) - 0.5) * 2 * noise
    with torch.no_grad():
        p = torch.softmax(target[valid] @ lm_head.T, dim=-1)
    total, weight = 0.0, 1.0
    for step in range(unroll):
        pred = head.forward_sequence(tokens, feats)  # [B, W, H]: f̂_{t+1} at t
        reg = F.smooth_l1_loss(pred[valid], target[valid])
        cls = -(p * torch.log_softmax(pred[valid] @ lm_head.T, dim=-1)).sum(-1).mean()
        total = total + weight * (reg + token_weight * cls)
        feats, weight = torch.cat([feats[:, :1], pred[:, :-1]], dim=1), weight / 2
    return total


@torch.no_grad()
def chain_ranks(head: EagleHead, lm_head: torch.Tensor, data: SequenceSet, depth: int, top: int,
                stride: int = 4, max_positions: int = 4096, nll: dict[float, float] | None = None) -> torch.Tensor:
    """[M, depth] ranks of the true tokens when the head drafts ``depth`` levels along the true
    continuation from position t on its own predicted features, as it does at inference.

    One re-fed pass per level over [true pairs | a chain of predicted pairs per sampled t];
    each chain pair sees the true pairs up to t and its own chain (an explicit mask).

    ``nll``: {temperature: summed negative log-likelihood of the true tokens under
    softmax(logits / temperature)}, accumulated over every level (for ``greedy_temperature``)."""
    out = []
    for i in range(len(data.lengths)):
        n, p = int(data.lengths[i]), int(data.prompt_lens[i])
        starts = list(range(max(p - 1, 0), n - depth - 1, stride))
        if not starts:
            continue
        toks, feats = data.tokens[i, 1:n], data.features[i, : n - 1]  # pairs (f_t, x_{t+1})
        m, c = len(starts), n - 1
        total = c + m * (depth - 1)
        allowed = torch.zeros(total, total, dtype=torch.bool)
        allowed[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
        pos = torch.cat([torch.arange(c), torch.zeros(m * (depth - 1), dtype=torch.long)])
        chain_tok = torch.zeros(m * (depth - 1), dtype=torch.long)
        for j, t in enumerate(starts):
            for d in range(1, depth):  # the chain pair at depth d+1 sits at position t + d
                row = c + j * (depth - 1) + (d - 1)
                allowed[row, : t + 1] = True
                allowed[row, c + j * (depth - 1) : row + 1] = True
                pos[row] = t + d
                chain_tok[j * (depth - 1) + d - 1] = data.tokens[i, t + d + 1]
        mask = torch.zeros(total, total).masked_fill(~allowed, float("-inf"))[None, None]
        pred_feats = torch.zeros(m * (depth - 1), feats.shape[-1])
        ranks = torch.full((m, depth), -1)
        for level in range(depth):
            hidden = head.fuse(torch.cat([toks, chain_tok])[None], torch.cat([feats, pred_feats])[None])
            rope = head.rotary_emb(hidden, position_ids=pos[None])
            for layer in head.layers:
                hidden = layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=pos[None])
            hidden = hidden[0]
            at = torch.tensor(starts) if level == 0 else c + torch.arange(m) * (depth - 1) + (level - 1)
            labels = data.tokens[i, torch.tensor(starts) + level + 2]
            level_logits = hidden[at] @ lm_head.T
            ranks[:, level] = ranks_of(level_logits, labels, top)
            for tau in nll or ():
                nll[tau] += F.cross_entropy(level_logits / tau, labels, reduction="sum").item()
            if level + 1 < depth:  # the next chain pair reads this level's predicted feature
                pred_feats[torch.arange(m) * (depth - 1) + level] = hidden[at]
        out.append(ranks)
        if sum(len(r) for r in out) >= max_positions:
            break
    return torch.cat(out)


@torch.no_grad()
def measure_step_cost(target: str, head, max_nodes: int, repeats: int = 30,
                      bind: Callable | None = None) -> Callable[[int, int], float]:
    """``cost(nodes, depth)``: seconds of one EAGLE step on this machine, one thread — the
    target verifying the root + ``nodes`` under a tree mask, and ``depth`` head forwards
    (the catch-up, then one per level below the first). ``bind(head, target_runner)``
    attaches a copy of the head to the target (default: EAGLE-1's embedding + LM head)."""
    import copy
    import statistics

    import numpy as np
    from transformers import AutoModelForCausalLM

    from specray.engine.runner import ModelRunner
    from specray.kernels.tree import chain_tree

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = ModelRunner(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), 1, 512)
        bind = bind or (lambda h, r: h.bind(r.decoder.embed_tokens, r.lm_head))
        probe = bind(copy.deepcopy(head), runner)
        head_runner = ModelRunner(probe, 1, 512)
        prefix = [1 + i % (runner.vocab_size - 1) for i in range(64)]
        runner.forward([0], [prefix])
        feats = torch.zeros(len(prefix), runner.hidden_size)
        head_runner.forward([0], [prefix], embeds=[probe.fuse(torch.tensor(prefix), feats)])

        def timed(fn) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        def verify(q: int) -> None:
            tree = chain_tree(q - 1)
            runner.forward([0], [[1] * q], torch.arange(q)[None], layout=(tree.mask[None], tree.depth[None]))
            runner.set_length(0, len(prefix))

        def head_step() -> None:
            head_runner.forward([0], [[1]], embeds=[probe.fuse(torch.tensor([1]), feats[:1])])
            head_runner.set_length(0, len(prefix))

        sizes = sorted({1, 2, 5, 9, 17, 33, max_nodes + 1})
        verify_s = [timed(lambda: verify(q)) for q in sizes]
        head_s = timed(head_step)
    finally:
        torch.set_num_threads(threads)
    return lambda nodes, depth: float(np.interp(nodes + 1, sizes, verify_s)) + depth * head_s


def train_eagle(target: str, out: str, tokenizer: str | None = None, steps: int = 1200, batch_size: int = 16,
                width: int = 256, lr: float = 3e-3, noise: float = 0.1, token_weight: float = 1.0, unroll: int = 1,
                sequences: int = 1024, gen_len: int = 128, tree_size: int = 16, depth: int = 6, seed: int = 0,
                prompts: PromptSource | None = None) -> dict:
    """Train, measure on held-out continuations, fit the default tree, save; returns a report."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed, prompts)
    cfg = head_config(target)
    cfg._attn_implementation = "sdpa"
    head = EagleHead(cfg)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    last = model.get_decoder().layers[-1].state_dict()
    head.layers[0].load_state_dict({k: v for k, v in last.items() if not k.startswith("input_layernorm")})
    del model
    head.bind(_Frozen(data.embed), _Frozen(data.lm_head))
    lm_head = data.lm_head

    final = optimise(head.parameters(), lambda step: eagle_loss(head, lm_head, windows(data.train, batch_size, width, gen),
                                                                noise, token_weight, unroll),
                     steps, lr, "eagle head", clip=0.5)
    head.eval()
    nll = temperature_grid()
    ranks = chain_ranks(head, lm_head, data.held_out, depth, top=8, nll=nll)
    cost = measure_step_cost(target, head, tree_size)
    return {"head_dir": out, "steps": steps, "final_loss": round(final, 4),
            **fit_and_save(head, ranks, nll, cost, tree_size, out, target),
            "data_seconds": round(data.seconds, 1), "seconds": round(time.time() - start, 1)}


def temperature_grid() -> dict[float, float]:
    """Candidate greedy-rows temperatures 0.1 .. ~2.9, each with its NLL accumulator."""
    return {round(0.1 * 1.15 ** i, 4): 0.0 for i in range(25)}


def fit_and_save(head, ranks: torch.Tensor, nll: dict[float, float], cost: Callable[[int, int], float],
                 tree_size: int, out: str, target: str) -> dict:
    """From held-out drafting along the true continuations (``ranks`` [M, depth], ``nll`` per
    temperature): the greedy-rows temperature, the k-step accuracies and the fitted default
    tree, saved with the head (EAGLE's and EAGLE-3's recipes); returns the report's part."""
    head.greedy_temperature = min(nll, key=nll.get)
    depth = ranks.shape[1]
    accuracy = [round((ranks[:, d] == 0).float().mean().item(), 3) for d in range(depth)]
    # k-step accuracy: the first k levels all right (a chain of k accepted tokens)
    chain = [round((ranks[:, : d + 1] == 0).all(-1).float().mean().item(), 3) for d in range(depth)]
    choices, expected = fit_tree(ranks, tree_size, max_children=8, step_cost=cost)
    head.choices = choices
    head.save(out, base_model=target)
    tree_depth = max(len(c) for c in choices)
    return {
        "positions": int(ranks.shape[0]), "held_out_top1_per_depth": accuracy, "held_out_chain_accuracy": chain,
        "tree_size": len(choices), "expected_accepted_length": round(expected, 3),
        "chain_expected_accepted_length": round(1 + sum(chain), 3), "tree_depth": tree_depth,
        "greedy_temperature": head.greedy_temperature, "step_ms_plain": round(1000 * cost(0, 0), 3),
        "step_ms_tree": round(1000 * cost(len(choices), tree_depth), 3),
    }


EVAL_SPECS = {"fitted tree (EAGLE-1)": {}, "chain": {"tree": "chain"}, "EAGLE-2": {"dynamic_tree": True}}


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train eagle", __doc__)
    add_common_args(p, steps=1200, lr=3e-3)
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--width", type=int, default=256, help="pairs per window")
    p.add_argument("--noise", type=float, default=0.1, help="uniform noise half-width on input features")
    p.add_argument("--token-weight", type=float, default=1.0, help="weight of the token loss")
    p.add_argument("--depth", type=int, default=6, help="levels measured for the fitted tree")
    p.add_argument("--unroll", type=int, default=1, help="passes on the head's own features per step (1 = EAGLE)")
    return run_recipe(argv, p, "eagle", lambda a, target, tokenizer: train_eagle(
        target, a.out, tokenizer, steps=a.steps, batch_size=a.batch_size, width=a.width, lr=a.lr, noise=a.noise,
        token_weight=a.token_weight, unroll=a.unroll, sequences=a.sequences, gen_len=a.gen_len,
        tree_size=a.tree_size, depth=a.depth, seed=a.seed), EVAL_SPECS)

if __name__ == "__main__":
    import sys

    sys.exit(main())
