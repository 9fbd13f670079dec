"""One home for training draft heads on a frozen target (``specray train <method>``).

Written once here: the data — the target's own greedy continuations of corpus prompts
(what greedy decoding will ask a head to guess), the target's final-norm features at every
position cached once, a held-out split from other prompts — the optimisation loop with its
progress bar, and fitting a default tree to a head's measured ranks. A method's recipe
(``training/medusa.py``, ``training/eagle.py``, ...) is its head, its loss,
its rank measurement and its checkpoint.

    data = distill_data(target_dir, tokenizer_dir, sequences=1024, gen_len=128)
    loss = optimise(head.parameters(), lambda step: my_loss(head, data.train.sample(...)), steps=1500)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import heapq
import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from specray.engine.argparsing import SuggestingParser
from specray.engine.threads import free_threads

log = logging.getLogger(__name__)

PromptSource = Callable[[str, int, int], list[list[int]]]


def demo_corpus_prompts(tokenizer_dir: str) -> PromptSource:
    """Prompts cut from the demo corpus at line boundaries; the held-out ones use another
    seed than the benchmarks' ``held_out_prompts``, so fitting a tree does not see them."""
    from transformers import AutoTokenizer

    from specray.demo import corpus_prompts

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def source(split: str, n: int, seed: int) -> list[list[int]]:
        texts = corpus_prompts(n, tokenizer_dir, split, seed=seed, distinct_lengths=False)
        return [tok.encode(t, add_special_tokens=False) for t in texts]

    return source


@dataclass
class SequenceSet:
    """Prompts + the target's greedy continuations, with the target's features.

    tokens:   [N, T] int64, right-padded with 0
    features: [N, T, H] float32, the target's final-norm hidden state at each position
    lengths:  [N] tokens per sequence; prompt_lens: [N] of which prompt
    A position t "predicts" token t + 1; continuation positions (t >= prompt_len - 1) are
    the ones whose next token the target chose itself.
    """

    tokens: torch.Tensor
    features: torch.Tensor
    lengths: torch.Tensor
    prompt_lens: torch.Tensor
    taps: dict = field(default_factory=dict, repr=False)  # target_layer_inputs' cache

    def positions(self, ahead: int) -> torch.Tensor:
        """[P, 2] (sequence, t) of continuation positions with ``ahead`` known tokens after t."""
        rows = []
        for i, (n, p) in enumerate(zip(self.lengths.tolist(), self.prompt_lens.tolist())):
            t = torch.arange(max(p - 1, 0), n - ahead)
            rows.append(torch.stack([torch.full_like(t, i), t], dim=1))
        return torch.cat(rows)


@dataclass
class DistillData:
    """The two splits, the target's LM head weight [V, H] and token embedding [V, H]."""

    train: SequenceSet
    held_out: SequenceSet
    lm_head: torch.Tensor
    embed: torch.Tensor
    seconds: float


def greedy_continuations(engine, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """Each prompt followed by the target's own greedy continuation (EOS not special)."""
    from specray.engine import SamplingParams, SpeculationParams

    sampling = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    # A bar per finished sequence: this is minutes of work on a CPU, and must be seen to move.
    outputs = engine.generate(prompts, sampling, SpeculationParams(method="none"), use_tqdm=True)
    return [p + list(o.token_ids) for p, o in zip(prompts, outputs)]


@torch.no_grad()
def target_features(model, seqs: list[list[int]], batch_size: int = 16) -> torch.Tensor:
    """[N, T, H] final-norm hidden states of right-padded sequences (a causal model does not
    see the padding)."""
    decoder, pad = model.get_decoder(), model.config.pad_token_id or 0
    from tqdm import tqdm

    width = max(map(len, seqs))
    out = torch.zeros(len(seqs), width, model.config.hidden_size)
    for lo in tqdm(range(0, len(seqs), batch_size), desc="target features", unit="batch"):
        chunk = seqs[lo : lo + batch_size]
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in chunk])
        out[lo : lo + len(chunk)] = decoder(input_ids=ids).last_hidden_state.float()
    return out


@torch.no_grad()
def target_layer_inputs(target: str, data: SequenceSet, layers: tuple[int, ...], batch_size: int = 16) -> torch.Tensor:
    """[N, T, len(layers) * H] float32: the residual stream entering each decoder layer in
    ``layers`` (HF's ``output_hidden_states[k]``) at every position of ``data``'s sequences,
    concatenated — EAGLE-3's taps. Computed once per process for each (data, layers)."""
    key = (target, tuple(layers))
    if key not in data.taps:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        decoder, (n, width) = model.get_decoder(), data.tokens.shape
        out = torch.zeros(n, width, len(layers) * model.config.hidden_size)
        for lo in range(0, n, batch_size):
            states = decoder(input_ids=data.tokens[lo : lo + batch_size], output_hidden_states=True).hidden_states
            out[lo : lo + batch_size] = torch.cat([states[k] for k in layers], dim=-1).float()
        data.taps[key] = out
    return data.taps[key]


_DATA: dict[tuple, DistillData] = {}  # one process training several heads builds the data once
_DISK: list[str | None] = [None]  # a directory where processes share it (``--data-cache``), or None


def use_data_cache(directory: str | None) -> None:
    """Keep the corpus data on disk in ``directory`` too: another ``specray train`` with the same
    target, tokenizer, sequences, generation length and seed reads it instead of generating it
    again (the target's greedy continuations are deterministic)."""
    _DISK[0] = directory


def distill_data(target: str, tokenizer: str | None = None, sequences: int = 1024, gen_len: int = 128,
                 seed: int = 0, prompts: PromptSource | None = None, context: int = 512) -> DistillData:
    """Greedy continuations of ``sequences`` training prompts and ``sequences // 8`` held-out
    ones (another seed), with the target's features cached (per process, for the corpus
    prompts; on disk too with ``use_data_cache``)."""
    key = (target, tokenizer, sequences, gen_len, seed, context)
    if prompts is None and key in _DATA:
        return _DATA[key]
    disk = _disk_path(key) if prompts is None and _DISK[0] else None
    if disk is not None and disk.is_file():
        log.info("corpus data from %s", disk)
        data = torch.load(disk, weights_only=False)
    else:
        data = _distill_data(target, tokenizer, sequences, gen_len, seed, prompts, context)
        if disk is not None:
            partial = disk.with_name(f".{disk.name}.{os.getpid()}.partial")  # written aside: a reader sees it whole
            torch.save(dataclasses.replace(data, train=dataclasses.replace(data.train, taps={}),
                                           held_out=dataclasses.replace(data.held_out, taps={})), partial)
            partial.replace(disk)
    if prompts is None:
        _DATA[key] = data
    return data


def _disk_path(key: tuple) -> pathlib.Path:
    """The cache file of ``key``: named by its arguments and the target's weights' size and time."""
    target = pathlib.Path(key[0])
    stamp = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in sorted(target.glob("*.safetensors"))
             + sorted(target.glob("*.bin"))] if target.is_dir() else []
    digest = hashlib.sha256(repr((str(target.resolve()), *key[1:], stamp)).encode()).hexdigest()[:16]
    folder = pathlib.Path(_DISK[0])
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"distill-{key[2]}x{key[3]}-{digest}.pt"


def _distill_data(target, tokenizer, sequences, gen_len, seed, prompts, context) -> DistillData:
    from transformers import AutoModelForCausalLM

    from specray.engine import EngineConfig, LLMEngine

    start = time.time()
    prompts = prompts or demo_corpus_prompts(tokenizer or target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    context = min(context, model.config.max_position_embeddings)
    engine = LLMEngine(EngineConfig(target=target, tokenizer=tokenizer, max_num_seqs=64, max_model_len=context))
    sets = []
    for split, num, split_seed in (("train", sequences, seed), ("held_out", max(sequences // 8, 16), seed + 1)):
        log.info("the target's greedy continuations of %d %s prompts (%d tokens each)", num, split, gen_len)
        ids = [p[: context - gen_len] for p in prompts(split, num, split_seed)]
        seqs = greedy_continuations(engine, ids, gen_len)
        width = max(map(len, seqs))
        tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        sets.append(SequenceSet(tokens, target_features(model, seqs), torch.tensor([len(s) for s in seqs]),
                                torch.tensor([len(p) for p in ids])))
    lm_head = model.get_output_embeddings().weight.detach()
    embed = model.get_input_embeddings().weight.detach()
    return DistillData(sets[0], sets[1], lm_head, embed, time.time() - start)


def optimise(params: Iterable[torch.nn.Parameter], loss_at: Callable[[int], torch.Tensor], steps: int, lr: float,
             desc: str, weight_decay: float = 0.0, clip: float | None = None) -> float:
    """AdamW with a one-cycle schedule over ``loss_at(step)``; returns the last loss."""
    from tqdm import tqdm

    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    bar = tqdm(range(steps), desc=desc, unit="step")
    loss = torch.tensor(float("nan"))
    for step in bar:
        loss = loss_at(step)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        sched.step()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    return float(loss.item())


def fit_tree(ranks: torch.Tensor, size: int, max_children: int,
             step_cost: Callable[[int, int], float] | None = None) -> tuple[list[list[int]], float]:
    """The ``size`` rank paths most often fully right, and the expected accepted length
    ``1 + sum(values)``. ``ranks[n, d]``: where the head ranked the true token at depth d
    of example n (``-1`` if not in its top ``max_children``). A node's value is the measured
    fraction of examples whose next tokens sit at exactly its ranks (Medusa's sparse-tree
    idea, without assuming the depths independent); a prefix is never worth less than its
    extension, so the chosen nodes form a tree.

    With ``step_cost(nodes, depth)`` (seconds per step for a tree of that many nodes and
    depth, measured on this machine), the tree is the prefix of that value order with the
    most expected tokens per second, at most ``size`` nodes (a hardware-aware tree, as in
    Sequoia): a wider or deeper tree must buy enough accepted tokens to pay for itself."""
    n, depth = ranks.shape
    heap: list = []  # max-heap of (-value, path, mask of examples matching the path so far)
    everyone = torch.ones(n, dtype=torch.bool)

    def push(path: tuple[int, ...], parent_mask: torch.Tensor) -> None:
        mask = parent_mask & (ranks[:, len(path) - 1] == path[-1])
        value = mask.sum().item() / n
        if value > 0:
            heapq.heappush(heap, (-value, path, mask))

    for r in range(max_children):
        push((r,), everyone)
    chosen, values = [], []
    while heap and len(chosen) < size:
        neg, path, mask = heapq.heappop(heap)
        chosen.append(list(path))
        values.append(-neg)
        if len(path) < depth:
            for r in range(max_children):
                push(path + (r,), mask)
    if step_cost is None or not chosen:
        return chosen, 1.0 + sum(values)
    rates = [(1.0 + sum(values[:k])) / step_cost(k, max(len(c) for c in chosen[:k])) for k in range(1, len(chosen) + 1)]
    best = max(range(len(rates)), key=rates.__getitem__) + 1
    return chosen[:best], 1.0 + sum(values[:best])


def ranks_of(logits: torch.Tensor, labels: torch.Tensor, top: int) -> torch.Tensor:
    """Rank of each label among the ``top`` largest logits (-1 when outside): [..., V] -> [...]."""
    topk = logits.topk(top, dim=-1).indices
    hit = topk == labels[..., None]
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, -1))


# -- a recipe's command line ----------------------------------------------------------------
def resolve_target(target: str | None, tokenizer: str | None) -> tuple[str, str]:
    """The target and tokenizer dirs (default: the demo pair's target)."""
    if target is None:
        from specray.demo import load_or_build_demo_pair

        pair = load_or_build_demo_pair()
        return pair.target, tokenizer or pair.tokenizer
    return target, tokenizer or target


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it has none or its help gives it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        none = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not none and "(default" not in text and "default:" not in text:
            text += " (default: %(default)s)"
        return text


def recipe_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """A recipe's command line (``specray train NAME``): its docstring's first paragraph, and
    every option's default in ``--help``."""
    return SuggestingParser(prog=prog, description=doc.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)


def add_common_args(p: argparse.ArgumentParser, steps: int, lr: float) -> None:
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the demo target)")
    p.add_argument("--tokenizer", default=None, help="default: the target dir, or the demo tokenizer")
    p.add_argument("--out", required=True, help="output dir (the method's public layout)")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=lr, help="learning rate")
    p.add_argument("--sequences", type=int, default=1024, help="greedy continuations to train on")
    p.add_argument("--gen-len", type=int, default=128, help="tokens per continuation")
    p.add_argument("--tree-size", type=int, default=16, help="nodes in the fitted default tree")
    p.add_argument("--seed", type=int, default=0, help="of the data and the initial weights")
    p.add_argument("--threads", type=int, default=None, help="torch threads while training (default: the cores "
                   "this process may use less the machine's load, at least 1; give N for a bit-reproducible run)")
    p.add_argument("--no-eval", action="store_true", help="skip measuring the mean accepted length")
    p.add_argument("--data-cache", default=os.environ.get("SPECRAY_DISTILL_CACHE"), metavar="DIR",
                   help="keep the target's continuations and features in DIR, and read them from there when a "
                        "recipe asks for the same data again (default: $SPECRAY_DISTILL_CACHE, else none)")


# Held-out prompts the saved acceptance is measured on. Acceptance varies more between texts
# than between heads: on the demo pair, the README recipe's EAGLE-3 head accepts its first depth
# 0.60 of the time on 8 held-out prompts and 0.84 on 32 (``measure_acceptance(...,
# num_prompts=8)`` against the default; the 8 hold a codec table and an __all__ list), and the self-tuning controller starts from this figure (a fresh one per `specray
# generate` request), so a few prompts made a drafter that pays look like one that does not.
ACCEPTANCE_PROMPTS = 32


def measure_accepted_length(target: str, tokenizer: str | None, method: str, head_dir: str, specs: dict[str, dict],
                            num_prompts: int = ACCEPTANCE_PROMPTS, max_tokens: int = 64,
                            prompts: list[list[int]] | None = None) -> dict[str, float]:
    """Per named spec: the engine's mean accepted length (1 + accepted / drafts) of greedy
    ``method`` with its weights from ``head_dir``, on held-out prompts (the demo's, or
    ``prompts``: token ids)."""
    measured = measure_acceptance(target, tokenizer, method, head_dir, specs, num_prompts, max_tokens, prompts)
    return {name: m["mean_accepted_length"] for name, m in measured.items()}


def measure_acceptance(target: str, tokenizer: str | None, method: str, head_dir: str, specs: dict[str, dict],
                       num_prompts: int = ACCEPTANCE_PROMPTS, max_tokens: int = 64,
                       prompts: list[list[int]] | None = None) -> dict[str, dict]:
    """Per named spec, as ``measure_accepted_length``: ``mean_accepted_length`` and
    ``acceptance``, the acceptance per draft position (tree depth) given the one before —
    what the self-tuning controller estimates while serving, and starts from when a head
    saves it (``save_acceptance``). The speculation length is fixed while measuring (every
    step drafts), so the numbers describe the drafts, not a controller's choices."""
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams
    from specray.policies.spec_length import SpeculationLengthPolicy

    engine = LLMEngine(EngineConfig(target=target, tokenizer=tokenizer, checkpoints={method: head_dir},
                                    max_num_seqs=4, speculation_length=SpeculationLengthPolicy()))
    if prompts is None:
        from specray.demo import held_out_prompts

        prompts = held_out_prompts(num_prompts, tokenizer)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    result = {}
    for name, spec in specs.items():
        before = engine.totals.num_drafts, engine.totals.num_accepted_tokens, list(engine.totals.accepted_per_pos)
        engine.generate(prompts, sampling, SpeculationParams(method=method, **spec))
        drafts = engine.totals.num_drafts - before[0]
        per_pos = [n - (before[2][j] if j < len(before[2]) else 0)
                   for j, n in enumerate(engine.totals.accepted_per_pos)]
        result[name] = {"mean_accepted_length": round(1 + (engine.totals.num_accepted_tokens - before[1])
                                                      / max(drafts, 1), 3),
                        "acceptance": acceptance_rates(drafts, per_pos)}
    return result


def record_acceptance(target: str, tokenizer: str | None, method: str, head_dir: str,
                      measured: dict | None = None, **measure) -> dict:
    """Save the acceptance of the head's default speculation (``{"method": method}``) into its
    config.json (``specray_acceptance``), measured here unless ``measured`` (a
    ``measure_acceptance`` entry) is given: what the self-tuning controller starts from."""
    from specray.policies.checkpoint_files import save_acceptance

    if measured is None:
        measured = measure_acceptance(target, tokenizer, method, head_dir, {"default": {}}, **measure)["default"]
    if measured["acceptance"]:
        save_acceptance(head_dir, measured["acceptance"])
    return measured


def acceptance_rates(drafts: int, accepted_per_pos: list[int]) -> list[float]:
    """Acceptance at each draft position given the one before, from counts: position 0 is
    reached by every draft, position j by those that accepted j - 1 (a position reached by
    none ends the list)."""
    rates, reached = [], drafts
    for accepted in accepted_per_pos:
        if reached <= 0:
            break
        rates.append(round(accepted / reached, 3))
        reached = accepted
    return rates


def run_recipe(argv: list[str] | None, parser: argparse.ArgumentParser, method: str,
               train: Callable[[argparse.Namespace, str, str], dict], specs: dict[str, dict]) -> int:
    """A recipe's command line: parse, train on the resolved target, measure the saved head
    with each of ``specs`` (unless --no-eval), print the report as JSON."""
    args = parser.parse_args(argv)
    threads = args.threads or free_threads()
    log.info("training on %d torch thread%s%s", threads, "s" if threads > 1 else "",
             "" if args.threads else " (the cores free now: --threads N to choose)")
    torch.set_num_threads(threads)
    use_data_cache(args.data_cache)
    target, tokenizer = resolve_target(args.target, args.tokenizer)
    report = train(args, target, tokenizer)
    if not args.no_eval and specs:  # (a recipe that measured its own passes none)
        torch.set_num_threads(1)
        measured = measure_acceptance(target, tokenizer, method, args.out, specs)
        report["mean_accepted_length"] = {name: m["mean_accepted_length"] for name, m in measured.items()}
        default = next(name for name, spec in specs.items() if not spec)  # the head's own default
        report["acceptance"] = record_acceptance(target, tokenizer, method, args.out, measured[default])["acceptance"]
    print(json.dumps(report))
    return 0
