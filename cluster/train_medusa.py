"""``specray train medusa``: self-distil Medusa heads on the target's own predictions.

Head k (0-based) reads the target's final hidden state at position t and learns the
target's distribution for token t+k+2 — i.e. the target's own prediction at position
t+k+1 — by KL divergence, over windows of a text corpus (default: the demo corpus,
the standard library's training split). Only the heads train; each head's projection
starts from the target's LM head, its residual blocks from the identity. The result is
written in the public Medusa layout (``config.json`` + ``medusa_lm_head.safetensors``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import torch.nn.functional as F

from specray.policies.medusa import MedusaHeads

log = logging.getLogger(__name__)


def corpus_ids(tokenizer, max_tokens: int, seed: int) -> torch.Tensor:
    from specray.demo import corpus_text

    text = corpus_text("train")
    ids = tokenizer.encode(text[: max_tokens * 6], add_special_tokens=False)[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def train_medusa(
    target: str,
    out: str,
    tokenizer: str | None = None,
    heads: int = 4,
    layers: int = 1,
    steps: int = 300,
    batch_size: int = 8,
    seq_len: int = 256,
    lr: float = 2e-3,
    seed: int = 0,
    max_corpus_tokens: int = 2_000_000,
) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tokenizer or target)
    data = corpus_ids(tok, max_corpus_tokens, seed)
    if len(data) < seq_len + heads + 2:
        raise ValueError(f"corpus too small: {len(data)} tokens")
    cfg = model.config
    medusa = MedusaHeads(cfg.hidden_size, model.get_output_embeddings().weight.shape[0], heads, layers)
    for head in medusa.heads:
        head[-1].weight.data.copy_(model.get_output_embeddings().weight.data)
    opt = torch.optim.AdamW(medusa.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    start = time.time()
    bar = tqdm(range(steps), desc="medusa heads", unit="step")
    for step in bar:
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        with torch.no_grad():
            hidden = decoder(input_ids=ids).last_hidden_state  # [b, L, H]
            teacher = F.log_softmax(lm_head(hidden).float(), dim=-1)  # [b, L, V]: target's next-token dist
        loss = 0.0
        for k, head in enumerate(medusa.heads):
            # Position t predicts token t+k+2: the target's prediction made at t+k+1.
            pred = F.log_softmax(head(hidden[:, : seq_len - k - 1]).float(), dim=-1)
            loss = loss + F.kl_div(pred, teacher[:, k + 1 :], log_target=True, reduction="batchmean") / seq_len
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    medusa.save(out, base_model=target)
    return {"heads_dir": out, "steps": steps, "seconds": round(time.time() - start, 1), "final_loss": loss.item()}


def evaluate(target: str, heads_dir: str, tokenizer: str, num_prompts: int = 8, max_tokens: int = 64) -> dict:
    """Mean accepted length of greedy Medusa on held-out prompts, per named tree."""
    from specray.demo import held_out_prompts
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams
    from specray.kernels.tree import NAMED_TREES

    engine = LLMEngine(EngineConfig(target=target, tokenizer=tokenizer, medusa=heads_dir, max_num_seqs=4))
    prompts = held_out_prompts(num_prompts, tokenizer)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = {}
    for name in NAMED_TREES:
        before = engine.totals.num_drafts, engine.totals.num_accepted_tokens
        engine.generate(prompts, sampling, SpeculationParams(method="medusa", tree=name))
        drafts = engine.totals.num_drafts - before[0]
        accepted = engine.totals.num_accepted_tokens - before[1]
        result[name] = round(1 + accepted / max(drafts, 1), 3)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray train medusa", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the demo target)")
    p.add_argument("--tokenizer", default=None, help="default: the target dir, or the demo tokenizer")
    p.add_argument("--out", required=True, help="output dir (public Medusa layout)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-eval", action="store_true", help="skip the mean-accepted-length report")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tokenizer = args.target, args.tokenizer
    if target is None:
        from specray.demo import load_or_build_demo_pair

        pair = load_or_build_demo_pair()
        target, tokenizer = pair.target, tokenizer or pair.tokenizer
    report = train_medusa(target, args.out, tokenizer, args.heads, args.layers, args.steps, args.batch_size,
                          args.seq_len, args.lr, args.seed)
    if not args.no_eval:
        torch.set_num_threads(1)
        report["mean_accepted_length"] = evaluate(target, args.out, tokenizer or target)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
