"""``specray train eagle3``: an EAGLE-3 head distilled from the target with EAGLE-3's
training-time test.

Data from ``training/base.py``: greedy continuations of corpus prompts, the target's
final-norm features (its next-token distributions, through its LM head) and its taps — the
residual stream entering layers 2, L//2 and L-3 (``target_layer_inputs``).

* Draft vocabulary: the ``draft_vocab`` tokens most frequent in the training sequences
  (EAGLE-3 counts its training data's tokens), saved as ``d2t``/``t2d``.
* The training-time test (``Eagle3Head.unrolled``): ``steps`` passes over windows of each
  sequence, pass j reading the head's own h from pass j-1 (pass 0 the fused taps) and the
  true token j places ahead, attending to the committed pairs and its own chain — exactly the
  chain drafted at inference. Pass j's loss is the cross-entropy of the head's distribution
  against the target's distribution of the token j + 2 ahead, restricted to the draft
  vocabulary (positions whose target argmax lies outside it are masked), weighted
  ``decay ** j`` (EAGLE-3: 7 passes, 0.8). No feature regression.
* Optimiser: AdamW, one-cycle, peak lr 1e-2 (on the demo target, 100 steps at 1e-2 reach a
  held-out top-1 of 0.47-0.55 where 3e-3 reaches 0.40-0.45). Measured there (held-out top-1
  at depth 1 / chain accuracy at depth 6): 1000 steps, ``--label-temperature 0.25``, width 64:
  0.76 / 0.38 (600 steps: 0.74 / 0.37); the same with ``--layers 2,6,11``: 0.76 / 0.39; 2000 steps: 0.51 / 0.15;
  2048 sequences, 1500 steps: 0.66 / 0.25; the earlier default (lr 3e-3, label temperature 1,
  2000 steps): 0.57 / 0.18 — longer runs do not help, so watch the held-out numbers.
* Warm start (``--init target``, the default; ``random`` is EAGLE-3's): the LM head takes
  the target's rows of the draft vocabulary and its final norm, the midlayer the target's
  last layer (attention reading the fused-feature half), ``fc`` the high tap — a short CPU
  budget goes further from there.

Held out, the unrolled passes along the true continuation are the drafted chain: their
per-depth ranks give the k-step accuracies, the greedy-rows temperature (as EAGLE's recipe)
and the fitted static tree (``training.fit_tree`` with this machine's step cost; drafted with
``dynamic_tree: false``), saved in the public EAGLE-3 layout with specray's ``eagle_choices``.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specray.training.eagle import fit_and_save, head_config, measure_step_cost, temperature_grid
from specray.training.base import (
    PromptSource, SequenceSet, add_common_args, recipe_parser, distill_data, optimise, ranks_of, run_recipe,
    target_layer_inputs,
)
from specray.policies.eagle3 import Eagle3Head, default_layers

DECAY = 0.8  # EAGLE-3's per-pass loss weight


def draft_vocab(data: SequenceSet, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent tokens of the sequences (increasing ids), and the share of
    the continuations' tokens they cover."""
    valid = torch.arange(data.tokens.shape[1])[None] < data.lengths[:, None]
    counts = torch.bincount(data.tokens[valid], minlength=int(data.tokens.max()) + 1).float()
    ids = counts.topk(min(size, len(counts))).indices.sort().values
    cont = valid & (torch.arange(data.tokens.shape[1])[None] >= data.prompt_lens[:, None])
    covered = torch.isin(data.tokens[cont], ids).float().mean().item()
    return ids, covered


def init_from_target(head: Eagle3Head, target: str) -> None:
    """Warm start: LM head rows and final norm of the target; the midlayer from its last layer
    (q/k/v on the fused-feature half); fc passing the high tap through."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    last, hidden = model.get_decoder().layers[-1], head.config.hidden_size
    layer = head.midlayer
    with torch.no_grad():
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[head.target_ids])
        head.norm.weight.copy_(model.get_decoder().norm.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(layer.self_attn, name).weight
            w.zero_()
            w[:, hidden:] = getattr(last.self_attn, name).weight
        layer.self_attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
        layer.mlp.load_state_dict(last.mlp.state_dict())
        layer.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
        layer.hidden_norm.load_state_dict(last.input_layernorm.state_dict())
        layer.input_layernorm.weight.fill_(1.0)
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * hidden :] = torch.eye(hidden)


def window_index(data: SequenceSet, batch: int, width: int, gen: torch.Generator):
    """``batch`` windows of ``width`` positions ending inside each sequence's continuation:
    (sequence [B], t [B, W] clamped to n - 2, valid [B, W]: t <= n - 2, so x_{t+1} exists)."""
    seq = torch.randint(0, len(data.lengths), (batch,), generator=gen)
    lengths, prompt = data.lengths[seq], data.prompt_lens[seq]
    hi = lengths - 1 - width
    lo = torch.clamp(prompt - width // 2, min=0)
    start = torch.minimum(lo + (torch.rand(batch, generator=gen) * (hi - lo + 1).clamp(min=1)).long(), hi.clamp(min=0))
    t = start[:, None] + torch.arange(width)  # [B, W]
    valid = t <= (lengths - 2)[:, None]
    return seq, torch.minimum(t, (lengths - 2)[:, None]), valid


def feature_labels(head: Eagle3Head, lm_head: torch.Tensor, features: torch.Tensor, label_temperature: float = 1.0):
    """The recipe's labels: at a position, the target's next-token distribution (its final-norm
    feature there through its LM head, at ``label_temperature``) renormalised over the draft
    vocabulary, and whether the target's argmax lies inside it.

    ``labels(rows, pos)``: rows, pos [B, W] -> (p [B, W, Vd], inside [B, W] bool)."""
    def labels(rows: torch.Tensor, pos: torch.Tensor):
        logits = features[rows, pos] @ lm_head.T  # [B, W, V]
        p = torch.softmax(logits[..., head.target_ids] / label_temperature, dim=-1)
        return p, head.t2d[logits.argmax(-1)]

    return labels


def eagle3_loss(head: Eagle3Head, labels, data: SequenceSet, taps: torch.Tensor, index, steps: int,
                decay: float = DECAY) -> torch.Tensor:
    """The training-time test's loss over windows ``index`` (``window_index``); ``labels`` gives
    the target's distribution at a position (``feature_labels``; online learning: the captured
    top-k, ``training/online.py``). Positions whose label's argmax lies outside the draft
    vocabulary are masked."""
    seq, t, valid = index
    rows, n = seq[:, None].expand_as(t), data.lengths[seq][:, None]  # [B, W], [B, 1]
    col = torch.arange(t.shape[1])[None]
    hs = head.unrolled(data.tokens[rows, t + 1], taps[rows, t], steps)  # steps x [B, W, H]
    total = 0.0
    for j, h in enumerate(hs):
        ahead = t + j + 1  # the target's distribution there is the one of x_{t+j+2}
        with torch.no_grad():
            p, inside = labels(rows, ahead.clamp(max=n - 1))  # renormalised over the draft vocabulary
            mask = valid & (ahead <= n - 1) & (col + j < t.shape[1]) & inside
        logq = torch.log_softmax(head.draft_logits(h).float(), dim=-1)
        total = total + decay ** j * -(p * logq).sum(-1)[mask].mean()
    return total


@torch.no_grad()
def chain_ranks(head: Eagle3Head, data: SequenceSet, taps: torch.Tensor, depth: int, top: int,
                nll: dict[float, float] | None = None, batch: int = 16) -> torch.Tensor:
    """[M, depth] ranks (among the target vocabulary's logits) of the true tokens when the head
    drafts ``depth`` levels along the true continuation from each continuation position.

    ``nll``: {temperature: summed negative log-likelihood of the true tokens inside the draft
    vocabulary under softmax(draft logits / temperature)}, over every level."""
    out = []
    for lo in range(0, len(data.lengths), batch):
        n, p = data.lengths[lo : lo + batch], data.prompt_lens[lo : lo + batch]
        width = int(n.max()) - 1
        hs = head.unrolled(data.tokens[lo : lo + batch, 1 : width + 1], taps[lo : lo + batch, :width], depth)
        t = torch.arange(width)[None]
        starts = (t >= (p - 1).clamp(min=0)[:, None]) & (t + depth + 1 <= (n - 1)[:, None])  # [b, width]
        ranks = torch.full((int(starts.sum()), depth), -1)
        for j, h in enumerate(hs):
            labels = data.tokens[lo : lo + batch, 2 + j : 2 + j + width]
            labels = F.pad(labels, (0, width - labels.shape[1]))[starts]  # x_{t+j+2}
            draft = head.draft_logits(h[starts]).float()  # [M, Vd]
            ranks[:, j] = ranks_of(head.target_logits(draft), labels, top)
            inside = head.t2d[labels]
            for tau in nll or ():
                target_logits = head.target_logits(draft[inside] / tau)
                nll[tau] += F.cross_entropy(target_logits, labels[inside], reduction="sum").item()
        out.append(ranks)
    return torch.cat(out)


def train_eagle3(target: str, out: str, tokenizer: str | None = None, steps: int = 1200, batch_size: int = 16,
                 width: int = 128, lr: float = 1e-2, unroll: int = 7, decay: float = DECAY, vocab: int = 1024,
                 init: str = "target", layers: tuple[int, ...] | None = None, label_temperature: float = 1.0,
                 sequences: int = 1024,
                 gen_len: int = 128, tree_size: int = 16, depth: int = 6, seed: int = 0,
                 prompts: PromptSource | None = None) -> dict:
    """Train, measure on held-out continuations, fit the default tree, save; returns a report."""
    from transformers import AutoConfig

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    data = distill_data(target, tokenizer, sequences, gen_len, seed, prompts)
    num_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    chosen = tuple(layers) if layers else None
    layers = chosen or default_layers(num_layers)
    if len(layers) != 3 or not all(0 <= k < num_layers for k in layers):
        raise ValueError(f"EAGLE-3 reads 3 target layers in 0..{num_layers - 1}; got {list(layers)} "
                         f"(the default 2, L//2, L-3 needs a target of at least 5 layers)")
    taps, held_taps = (target_layer_inputs(target, d, layers) for d in (data.train, data.held_out))
    cfg = head_config(target)
    cfg._attn_implementation = "sdpa"
    ids, coverage = draft_vocab(data.train, vocab)
    cfg.draft_vocab_size = len(ids)
    head = Eagle3Head(cfg)
    head.set_vocab(ids)
    head.configured_layers = chosen  # saved in config.json when not the default
    if init == "target":
        init_from_target(head, target)
    head.bind(torch.nn.Embedding.from_pretrained(data.embed, freeze=True), num_layers)
    data_seconds = time.time() - start

    labels = feature_labels(head, data.lm_head, data.train.features, label_temperature)
    final = optimise(head.parameters(), lambda step: eagle3_loss(
        head, labels, data.train, taps, window_index(data.train, batch_size, width, gen), unroll, decay),
        steps, lr, "eagle3 head", clip=0.5)
    head.eval()
    nll = temperature_grid()
    ranks = chain_ranks(head, data.held_out, held_taps, depth, top=8, nll=nll)
    cost = measure_step_cost(target, head, tree_size, bind=lambda h, r: h.bind(r.decoder.embed_tokens, r.num_layers))
    return {"head_dir": out, "steps": steps, "unroll": unroll, "final_loss": round(final, 4), "draft_vocab": len(ids),
            "draft_vocab_coverage": round(coverage, 4), "layers": list(layers),
            **fit_and_save(head, ranks, nll, cost, tree_size, out, target),
            "data_seconds": round(data_seconds, 1), "seconds": round(time.time() - start, 1)}


EVAL_SPECS = {"EAGLE-2 dynamic tree (default)": {}, "fitted tree": {"dynamic_tree": False}, "chain": {"tree": "chain"}}


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("specray train eagle3", __doc__)
    add_common_args(p, steps=1200, lr=1e-2)
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--width", type=int, default=128, help="positions per window")
    p.add_argument("--unroll", type=int, default=7, help="self-fed passes of the training-time test")
    p.add_argument("--decay", type=float, default=DECAY, help="loss weight of pass j: decay ** j")
    p.add_argument("--draft-vocab", type=int, default=1024, help="tokens in the draft vocabulary")
    p.add_argument("--init", choices=("target", "random"), default="target", help="warm start from the target or not")
    p.add_argument("--depth", type=int, default=6, help="levels measured for the fitted tree")
    p.add_argument("--label-temperature", type=float, default=1.0,
                   help="temperature of the target's distribution used as the label (1 = EAGLE-3's; "
                        "0.25 trains a better greedy drafter on the demo pair)")
    p.add_argument("--layers", default=None, help="the 3 target layers whose inputs the head reads, e.g. 2,6,11 "
                                                   "(default 2, L//2, L-3)")
    return run_recipe(argv, p, "eagle3", lambda a, target, tokenizer: train_eagle3(
        target, a.out, tokenizer, steps=a.steps, batch_size=a.batch_size, width=a.width, lr=a.lr, unroll=a.unroll,
        decay=a.decay, vocab=a.draft_vocab, init=a.init, layers=_layer_list(a.layers),
        label_temperature=a.label_temperature, sequences=a.sequences,
        gen_len=a.gen_len, tree_size=a.tree_size, depth=a.depth, seed=a.seed), EVAL_SPECS)


def _layer_list(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise ValueError(f"--layers takes comma-separated layer indices, got {text!r}") from None


if __name__ == "__main__":
    import sys

    sys.exit(main())
