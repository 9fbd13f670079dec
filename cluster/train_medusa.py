"""``specray train medusa``: self-distil Medusa heads on the target's own greedy continuations.

1. Prompts are random windows of a text corpus (default: the demo corpus's training split);
   the frozen target continues each greedily. Those continuations are exactly what greedy
   decoding will ask the heads to guess, so they are the labels: head k (0-based) reads the
   target's final hidden state at position t and learns the token at t+k+2.
2. The target runs once per sequence to cache its hidden states; only the heads train, on
   the cache (each head's projection starts from the target's LM head, its residual blocks
   from the identity): the default 1500 steps took about 2.6 CPU minutes on the demo
   target (README, "Results").
3. A tree is fitted to the trained heads on continuations of held-out prompts (Medusa's
   sparse-tree idea, without its independence assumption): a node is a tuple of per-head
   ranks, its value the measured fraction of positions whose next tokens sit at exactly
   those ranks, and the ``tree_size`` most valuable nodes form the tree (a prefix is never
   worth less than its extension, so the result is a valid tree). Its expected accepted
   length is 1 + the sum of its nodes' values.

The result is written in the public Medusa layout (``config.json`` + ``medusa_lm_head
.safetensors``); the fitted tree goes into ``config.json`` as ``medusa_choices`` and is the
heads' default tree.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import time
from typing import Callable

import torch
import torch.nn.functional as F

from specray.policies.medusa import MedusaHeads

log = logging.getLogger(__name__)


PromptSource = Callable[[str, int, int], list[list[int]]]


def demo_corpus_prompts(tokenizer_dir: str) -> PromptSource:
    """Prompts cut from the demo corpus at line boundaries; the held-out ones use another
    seed than the benchmarks' ``held_out_prompts``, so fitting the tree does not see them."""
    from transformers import AutoTokenizer

    from specray.demo import corpus_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def source(split: str, n: int, seed: int) -> list[list[int]]:
        texts = corpus_prompts(n, tokenizer_dir, split, seed=seed, distinct_lengths=False)
        return [tok.encode(t, add_special_tokens=False) for t in texts]

    return source


def greedy_continuations(engine, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """Each prompt followed by the target's own greedy continuation (EOS not special)."""
    from specray.engine import SamplingParams, SpeculationParams

    sampling = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    outputs = engine.generate(prompts, sampling, SpeculationParams(method="none"))
    return [p + list(o.token_ids) for p, o in zip(prompts, outputs)]


@torch.no_grad()
def head_examples(model, prompts: list[list[int]], seqs: list[list[int]], num_heads: int, batch_size: int = 16):
    """The target's final (normed) hidden state at every position t whose next token is the
    target's own (t >= len(prompt) - 1), with head k's label ``seq[t + k + 2]``: ``[N, H]``,
    ``[N, K]``. Sequences are right-padded, which a causal model does not see."""
    decoder, pad = model.get_decoder(), model.config.pad_token_id or 0
    feats, labels = [], []
    for lo in range(0, len(seqs), batch_size):
        chunk = seqs[lo : lo + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
        hidden = decoder(input_ids=ids).last_hidden_state.float()
        for row, (prompt, seq) in enumerate(zip(prompts[lo : lo + batch_size], chunk)):
            t = torch.arange(len(prompt) - 1, len(seq) - num_heads - 1)
            seq_t = torch.tensor(seq)
            feats.append(hidden[row, t])
            labels.append(torch.stack([seq_t[t + k + 2] for k in range(num_heads)], dim=-1))
    return torch.cat(feats), torch.cat(labels)


def fit_tree(ranks: torch.Tensor, size: int, max_children: int) -> tuple[list[list[int]], float]:
    """The ``size`` rank-paths most often fully right (see the module doc), and the expected
    accepted length ``1 + sum(values)``. ``ranks[n, k]``: where head k ranked the true token at
    example n (``-1`` if not in its top ``max_children``)."""
    n, depth = ranks.shape
    # Max-heap of (−value, path, mask of examples matching the path so far).
    heap: list = []
    everyone = torch.ones(n, dtype=torch.bool)

    def push(path: tuple[int, ...], parent_mask: torch.Tensor) -> None:
        mask = parent_mask & (ranks[:, len(path) - 1] == path[-1])
        value = mask.sum().item() / n
        if value > 0:
            heapq.heappush(heap, (-value, path, mask))

    for r in range(max_children):
        push((r,), everyone)
    chosen, total = [], 0.0
    while heap and len(chosen) < size:
        neg, path, mask = heapq.heappop(heap)
        chosen.append(list(path))
        total -= neg
        if len(path) < depth:
            for r in range(max_children):
                push(path + (r,), mask)
    return chosen, 1.0 + total


@torch.no_grad()
def head_ranks(medusa: MedusaHeads, feats: torch.Tensor, labels: torch.Tensor, top: int) -> torch.Tensor:
    """``[N, K]`` rank of each label among head k's top ``top`` (``-1`` when outside)."""
    ranks = []
    for i in range(0, len(feats), 8192):
        topk = medusa(feats[i : i + 8192]).topk(top, dim=-1).indices  # [n, K, top]
        hit = topk == labels[i : i + 8192, :, None]
        ranks.append(torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels[i : i + 8192], -1)))
    return torch.cat(ranks)


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
) -> dict:
    """Train, fit the tree, save; returns a report. ``prompts(split, n, seed)`` gives token-id
    prompts ("train" ones to learn from, "held_out" ones to fit the tree); by default they are
    cut from the demo corpus at line boundaries, like the prompts the demo serves."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from specray.engine import EngineConfig, LLMEngine

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    tokenizer = tokenizer or target
    prompts = prompts or demo_corpus_prompts(tokenizer)
    # A plain copy for whole-sequence forwards (the engine's runs on its own KV cache).
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    lm_head = model.get_output_embeddings().weight
    context = min(512, model.config.max_position_embeddings)
    engine = LLMEngine(EngineConfig(target=target, tokenizer=tokenizer, max_num_seqs=64, max_model_len=context))

    def examples(split: str, num: int, prompt_seed: int):
        ids = [p[: context - gen_len] for p in prompts(split, num, prompt_seed)]
        seqs = greedy_continuations(engine, ids, gen_len)
        return head_examples(model, ids, seqs, heads)

    with tqdm(total=2, desc="target continuations", unit="split") as bar:
        feats, labels = examples("train", sequences, seed)
        bar.update()
        val_feats, val_labels = examples("held_out", max(sequences // 8, 16), seed + 1)
        bar.update()
    data_seconds = time.time() - start

    medusa = MedusaHeads(model.config.hidden_size, lm_head.shape[0], heads, layers)
    for head in medusa.heads:
        head[-1].weight.data.copy_(lm_head.data)
    opt = torch.optim.AdamW(medusa.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    bar = tqdm(range(steps), desc="medusa heads", unit="step")
    for step in bar:
        idx = torch.randint(0, len(feats), (batch_size,), generator=gen)
        logits = medusa(feats[idx])  # [b, K, V]
        loss = F.cross_entropy(logits.flatten(0, 1), labels[idx].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    medusa.eval()

    ranks = head_ranks(medusa, val_feats, val_labels, top=8)
    top1 = [round((ranks[:, k] == 0).float().mean().item(), 3) for k in range(heads)]
    choices, expected = fit_tree(ranks, tree_size, max_children=8)
    medusa.choices = choices
    medusa.save(out, base_model=target)
    return {
        "heads_dir": out, "steps": steps, "final_loss": round(loss.item(), 3), "examples": len(feats),
        "held_out_top1_per_head": top1, "tree_size": len(choices),
        "expected_accepted_length": round(expected, 3),
        "data_seconds": round(data_seconds, 1), "seconds": round(time.time() - start, 1),
    }


def evaluate(target: str, heads_dir: str, tokenizer: str, num_prompts: int = 8, max_tokens: int = 64) -> dict:
    """Measured mean accepted length of greedy Medusa on held-out prompts, per tree."""
    from specray.demo import held_out_prompts
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams
    from specray.kernels.tree import NAMED_TREES

    engine = LLMEngine(EngineConfig(target=target, tokenizer=tokenizer, medusa=heads_dir, max_num_seqs=4))
    prompts = held_out_prompts(num_prompts, tokenizer)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = {}
    for name in [None, *NAMED_TREES]:
        before = engine.totals.num_drafts, engine.totals.num_accepted_tokens
        engine.generate(prompts, sampling, SpeculationParams(method="medusa", tree=name))
        drafts = engine.totals.num_drafts - before[0]
        accepted = engine.totals.num_accepted_tokens - before[1]
        result[name or "fitted (default)"] = round(1 + accepted / max(drafts, 1), 3)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray train medusa", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the demo target)")
    p.add_argument("--tokenizer", default=None, help="default: the target dir, or the demo tokenizer")
    p.add_argument("--out", required=True, help="output dir (public Medusa layout)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=2048, help="positions per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sequences", type=int, default=1024, help="greedy continuations to train on")
    p.add_argument("--gen-len", type=int, default=128, help="tokens per continuation")
    p.add_argument("--tree-size", type=int, default=16, help="nodes in the fitted default tree")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-eval", action="store_true", help="skip measuring the mean accepted length")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = args.target, args.tokenizer
    if target is None:
        from specray.demo import load_or_build_demo_pair

        pair = load_or_build_demo_pair()
        target, tokenizer = pair.target, tokenizer or pair.tokenizer
    report = train_medusa(target, args.out, tokenizer, heads=args.heads, layers=args.layers, steps=args.steps,
                          batch_size=args.batch_size, lr=args.lr, sequences=args.sequences, gen_len=args.gen_len,
                          tree_size=args.tree_size, seed=args.seed)
    if not args.no_eval:
        torch.set_num_threads(1)
        report["mean_accepted_length"] = evaluate(target, args.out, tokenizer or target)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
