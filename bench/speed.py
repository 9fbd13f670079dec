"""Speed benchmark: specray vs. Hugging Face ``generate`` on the demo pair (CPU, batch 1).

    python -m specray.bench.speed [--prompts 10] [--max-tokens 128] [--ks 2,4,6]
                                  [--ngram-ks 2,4,6] [--repeats 3] [--out DIR] [--quick]

What runs, side by side in one process (one prompt at a time, greedy, EOS ignored so
every run makes exactly ``--max-tokens`` tokens, ``torch.set_num_threads(1)``):

* specray plain (``method="none"``), specray draft at k=1 (for alpha) and each ``--ks``,
  specray ngram (prompt lookup, ``max_matching_ngram_size=2``) at each ``--ngram-ks``;
* HF plain ``generate``, HF ``assistant_model=draft`` with HF's own defaults (up to 20
  assistant tokens, stopped early by the draft's confidence; reported as HF does it),
  HF ``prompt_lookup_num_tokens`` at each ``--ngram-ks``.

One LLMEngine (``max_num_seqs=1``) serves every specray config; the HF models are separate
``AutoModelForCausalLM`` copies with ``attn_implementation="sdpa"``. Each config gets one
untimed warm-up; timed runs are interleaved (prompt by prompt, every config in turn), so
load from other processes on the shared cores spreads evenly over the configs, and there
are ``--repeats`` such passes, each (config, prompt) keeping its fastest time.

Reported: tokens/s (generated tokens / wall time, summed over prompts), the speed-up
over specray plain, mean accepted length, tokens per target forward, token-id
mismatches against specray plain and HF plain (must be 0: greedy speculation is
lossless), alpha (exact, by teacher-forcing both models along the target's greedy
output; and the engine's own k=1 acceptance rate), the cost ratio c (median time of a
one-token ``ModelRunner.forward`` of draft over target), and for draft configs the
speed-up bound (1 - a^(k+1)) / ((1 - a)(k c + 1)) with measured/bound; and, per specray
config, where a decode step's time goes: the runners' forward costs (target at the
verify width, draft forwards; sampled after every prompt round under the same load)
against the measured time per step, the rest being engine overhead.

Writes ``speed.txt`` (the table), ``speed.csv``, ``speed.png`` and ``speed.json`` to
``--out`` (default ``./specray-bench/``). ``main(argv)`` returns 0 (1 if any config's
tokens differ from the references).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from specray.bench import DEFAULT_OUT

log = logging.getLogger(__name__)

PROG = "python -m specray.bench.speed"
GOAL_BOUND_FRACTION = 0.9  # specray draft speed-up >= 0.9 x bound
GOAL_VS_HF = 1.3  # specray draft >= 1.3 x HF assisted; specray ngram >= 1.3 x HF prompt lookup


# -- configs -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    system: str  # "specray" | "hf"
    method: str  # "none" | "draft" | "ngram"
    k: int | None = None  # draft tokens per step; None = plain / HF's own schedule

    @property
    def name(self) -> str:
        label = {"none": "plain", "draft": "draft", "ngram": "ngram"}[self.method]
        if self.system == "hf":
            label = {"none": "plain", "draft": "assisted", "ngram": "prompt-lookup"}[self.method]
        if self.system == "hf" and self.method == "draft" and self.k is None:
            return "hf assisted (default)"
        return f"{self.system} {label}" + (f" k={self.k}" if self.k is not None else "")


@dataclasses.dataclass
class RunResult:
    token_ids: list[int]
    seconds: float
    target_forwards: int
    metrics: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ConfigResult:
    config: BenchConfig
    runs: list[RunResult] = dataclasses.field(default_factory=list)  # seconds = fastest pass
    all_seconds: list[list[float]] = dataclasses.field(default_factory=list)  # [prompt][pass]
    best_pass: list[int] = dataclasses.field(default_factory=list)  # [prompt] pass of the fastest run
    warmup_seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.runs)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per target forward, prefill included (HF and specray alike)."""
        fwd = sum(r.target_forwards for r in self.runs)
        return self.tokens / fwd if fwd else float("nan")

    @property
    def tokens_per_decode_step(self) -> float:
        """(tokens - 1) / (target forwards - 1) per prompt, summed: the prefill makes token 1."""
        fwd = sum(r.target_forwards - 1 for r in self.runs)
        return sum(len(r.token_ids) - 1 for r in self.runs) / fwd if fwd > 0 else float("nan")

    def spec_totals(self) -> dict[str, int]:
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
        return {k: sum(int(r.metrics.get(k, 0)) for r in self.runs) for k in keys}

    @property
    def mean_accepted_length(self) -> float:
        """specray: vLLM's 1 + accepted / drafts (steps that drafted); HF: tokens per decode step."""
        if self.config.system != "specray":
            return self.tokens_per_decode_step
        t = self.spec_totals()
        return 1.0 + t["num_accepted_tokens"] / t["num_drafts"] if t["num_drafts"] else 1.0

    @property
    def drafted_per_step(self) -> float:
        """specray: draft tokens offered per drafting step (< k when a proposer offers fewer)."""
        t = self.spec_totals()
        return t["num_draft_tokens"] / t["num_drafts"] if t["num_drafts"] else float("nan")

    @property
    def acceptance_rate(self) -> float:
        t = self.spec_totals()
        return t["num_accepted_tokens"] / t["num_draft_tokens"] if t["num_draft_tokens"] else float("nan")


def build_configs(ks: Sequence[int], ngram_ks: Sequence[int], alpha_k1: bool = True, hf_fixed_k: bool = False):
    draft_ks = sorted(set(ks) | ({1} if alpha_k1 else set()))
    configs = [BenchConfig("specray", "none")]
    configs += [BenchConfig("specray", "draft", k) for k in draft_ks]
    configs += [BenchConfig("specray", "ngram", k) for k in ngram_ks]
    configs += [BenchConfig("hf", "none"), BenchConfig("hf", "draft")]
    if hf_fixed_k:
        configs += [BenchConfig("hf", "draft", k) for k in ks]
    configs += [BenchConfig("hf", "ngram", k) for k in ngram_ks]
    return configs


# -- runners -------------------------------------------------------------------------
class SpecrayRunner:
    def __init__(self, engine, max_tokens: int):
        from specray.engine.params import SamplingParams, SpeculationParams

        self.engine = engine
        self._sampling = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        self._spec = SpeculationParams
        self.max_tokens = max_tokens

    def run(self, cfg: BenchConfig, prompt_ids: list[int], max_tokens: int | None = None) -> RunResult:
        spec = self._spec(method=cfg.method) if cfg.k is None else self._spec(
            method=cfg.method, num_speculative_tokens=cfg.k
        )
        sampling = self._sampling(max_tokens or self.max_tokens)
        start = time.perf_counter()
        (out,) = self.engine.generate([prompt_ids], sampling, spec)
        seconds = time.perf_counter() - start
        return RunResult(list(out.token_ids), seconds, int(out.metrics["target_forward_passes"]), dict(out.metrics))


class HFRunner:
    def __init__(self, target, draft, max_tokens: int, pad_token_id: int | None):
        self.target, self.draft = target, draft
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self._calls = 0
        target.register_forward_pre_hook(self._count)

    def _count(self, *_args):
        self._calls += 1

    def kwargs(self, cfg: BenchConfig) -> dict:
        kw: dict[str, Any] = {}
        if cfg.method == "draft":
            kw["assistant_model"] = self.draft
            if cfg.k is not None:  # optional fixed-k comparison (--hf-fixed-k)
                kw.update(num_assistant_tokens=cfg.k, num_assistant_tokens_schedule="constant",
                          assistant_confidence_threshold=0.0)
        elif cfg.method == "ngram":
            kw["prompt_lookup_num_tokens"] = cfg.k
        return kw

    @torch.inference_mode()
    def run(self, cfg: BenchConfig, prompt_ids: list[int], max_tokens: int | None = None) -> RunResult:
        n = max_tokens or self.max_tokens
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        self._calls = 0
        start = time.perf_counter()
        out = self.target.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=0,
            eos_token_id=None,  # never stop early: exactly n tokens, like ignore_eos
            pad_token_id=self.pad_token_id,
            **self.kwargs(cfg),
        )
        seconds = time.perf_counter() - start
        return RunResult(out[0, len(prompt_ids):].tolist(), seconds, self._calls)


# -- alpha and c -------------------------------------------------------------------------
@torch.inference_mode()
def teacher_forced_alpha(target, draft, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """Fraction of positions, along the target's greedy continuation, where the draft's
    argmax equals the target's (exact greedy per-token acceptance)."""
    matches = total = 0
    for prompt, cont in zip(prompts, continuations):
        if not cont:
            continue
        ids = torch.tensor([prompt + cont])
        keep = len(cont) + 1
        t_pred = target(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1)
        d_pred = draft(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1)
        matches += int((t_pred == d_pred).sum())
        total += len(cont)
    return matches / total if total else float("nan")


class ForwardCostSampler:
    """Times ``ModelRunner.forward`` of q new tokens after a ``len(prompt_ids)``-token
    cache, batch 1, for the target at each of ``target_qs`` and the draft at each of
    ``draft_qs``; logits at every new token, as verification asks for them.

    ``sample(n)`` times every case n times, interleaved (load noise hits all cases alike),
    and returns ``{(runner, q): [seconds]}``. The benchmark samples a chunk after every
    prompt round, so each timed generation has forward costs measured under the same load.
    Slot 0 of both runners is used and reset: call only while the engine is idle.
    """

    def __init__(self, target_runner, draft_runner, prompt_ids: list[int], target_qs: Sequence[int],
                 draft_qs: Sequence[int] = (1,), warmup: int = 2):
        self.runners = {"target": target_runner, "draft": draft_runner}
        self.prompt_ids = list(prompt_ids)
        self.cases = [("target", q) for q in sorted(set(target_qs))] + [("draft", q) for q in sorted(set(draft_qs))]
        self.tokens = (self.prompt_ids * 8)[: max(q for _, q in self.cases)]
        self.warmup = warmup

    def sample(self, n: int) -> dict[tuple[str, int], list[float]]:
        slot, length = 0, len(self.prompt_ids)
        times: dict[tuple[str, int], list[float]] = {case: [] for case in self.cases}
        try:
            for r in self.runners.values():
                r.reset(slot)
                r.forward([slot], [self.prompt_ids])
            for i in range(self.warmup + n):
                for name, q in self.cases:
                    r = self.runners[name]
                    r.set_length(slot, length)
                    start = time.perf_counter()
                    r.forward([slot], [self.tokens[:q]], torch.arange(q)[None])
                    elapsed = time.perf_counter() - start
                    if i >= self.warmup:
                        times[(name, q)].append(elapsed)
        finally:
            for r in self.runners.values():
                r.reset(slot)
        return times


def cost_table(times: dict[tuple[str, int], list[float]]) -> dict[str, dict[int, float]]:
    """Median ms per case: ``{"target": {q: ms}, "draft": {q: ms}}``."""
    out: dict[str, dict[int, float]] = {"target": {}, "draft": {}}
    for (name, q), ts in times.items():
        out[name][q] = statistics.median(ts) * 1e3
    return out


def prefill_ms(runner, prompt_ids: list[int], runs: int = 3) -> float:
    """Fastest of ``runs`` prefills of ``prompt_ids`` into slot 0 (reset afterwards); the
    minimum, since a load spike during one prefill would swamp a whole config's decode time."""
    ts = []
    try:
        for _ in range(runs):
            runner.reset(0)
            start = time.perf_counter()
            runner.forward([0], [prompt_ids])
            ts.append(time.perf_counter() - start)
    finally:
        runner.reset(0)
    return min(ts) * 1e3


def interp(table: dict[int, float], q: float) -> float:
    """Linear interpolation of a {q: ms} table (clamped at its ends)."""
    qs = sorted(table)
    if q <= qs[0]:
        return table[qs[0]]
    for a, b in zip(qs, qs[1:]):
        if q <= b:
            return table[a] + (table[b] - table[a]) * (q - a) / (b - a)
    return table[qs[-1]]


def speedup_bound(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. (2023): expected speed-up of k-token draft speculation."""
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


# -- the benchmark -------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 10; --quick 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default 128; --quick 32)")
    p.add_argument("--ks", default=None, help="draft k values, comma-separated (default 2,4,6; --quick 2)")
    p.add_argument("--ngram-ks", default=None,
                   help="prompt-lookup k values for specray and HF (default 2,4,6; --quick 2)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, 32 tokens, ks=2")
    p.add_argument("--no-k1", action="store_true", help="skip the specray draft k=1 config (alpha cross-check)")
    p.add_argument("--hf-fixed-k", action="store_true",
                   help="also run HF assisted at each --ks with a constant schedule (no confidence stop)")
    p.add_argument("--cost-runs", type=int, default=None,
                   help="timed runner forwards per (model, width) after each prompt round, for c and the "
                        "per-step decomposition (default 15; --quick 10)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed passes over all prompts; each (config, prompt) keeps its fastest (default 3; --quick 1)")
    p.add_argument("--seed", type=int, default=0, help="held-out prompt seed")
    args = p.parse_args(argv)
    quick = args.quick
    args.prompts = args.prompts if args.prompts is not None else (2 if quick else 10)
    args.max_tokens = args.max_tokens if args.max_tokens is not None else (32 if quick else 128)
    args.ks = _int_list(args.ks if args.ks is not None else ("2" if quick else "2,4,6"), "--ks")
    args.ngram_ks = _int_list(args.ngram_ks if args.ngram_ks is not None else ("2" if quick else "2,4,6"),
                              "--ngram-ks")
    args.cost_runs = args.cost_runs if args.cost_runs is not None else (10 if quick else 15)
    args.repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.prompts < 1 or args.max_tokens < 2:
        p.error("need --prompts >= 1 and --max-tokens >= 2")
    return args


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: expected integers >= 1, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else [str(a) for a in argv])
    args = parse_args(argv)
    command = f"{PROG} {shlex.join(argv)}".rstrip()
    print(f"$ {command}", flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_benchmark(args, command)
    finally:
        torch.set_num_threads(threads)
    return 0 if report["total_mismatches"] == 0 else 1


def run_benchmark(args: argparse.Namespace, command: str) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specray.demo import held_out_prompts, load_or_build_demo_pair
    from specray.engine.config import EngineConfig
    from specray.engine.llm_engine import LLMEngine

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    started = time.time()
    load_before = _loadavg()

    pair = load_or_build_demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(pair.tokenizer)
    prompts = held_out_prompts(args.prompts, pair.tokenizer, seed=args.seed)
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    engine = LLMEngine(EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer, max_num_seqs=1))
    hf_target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32, attn_implementation="sdpa").eval()
    hf_draft = AutoModelForCausalLM.from_pretrained(pair.draft, dtype=torch.float32, attn_implementation="sdpa").eval()
    runners = {
        "specray": SpecrayRunner(engine, args.max_tokens),
        "hf": HFRunner(hf_target, hf_draft, args.max_tokens, tokenizer.pad_token_id),
    }

    configs = build_configs(args.ks, args.ngram_ks, alpha_k1=not args.no_k1, hf_fixed_k=args.hf_fixed_k)
    results = {cfg: ConfigResult(cfg) for cfg in configs}
    warm_tokens = min(args.max_tokens, 32)
    bar = tqdm(total=len(configs) * (1 + args.repeats * len(prompt_ids)), desc="bench", unit="run",
               dynamic_ncols=True)
    for cfg in configs:  # one untimed warm-up per config
        bar.set_postfix_str(f"warm-up {cfg.name}")
        start = time.perf_counter()
        runners[cfg.system].run(cfg, prompt_ids[0], warm_tokens)
        results[cfg].warmup_seconds = time.perf_counter() - start
        bar.update(1)
    # Forward costs of the engine's own runners (c, verify width, draft step), sampled
    # after every prompt round; the draft runner is created with the draft proposer.
    draft_runner = engine.proposers.get("draft").runner
    max_q = max([1] + [k + 1 for k in args.ks] + [k + 1 for k in args.ngram_ks])
    sampler = ForwardCostSampler(engine.target, draft_runner, prompt_ids[0][:128], range(1, max_q + 1), (1, 2))
    chunks: dict[tuple[int, int], dict[tuple[str, int], list[float]]] = {}  # (pass, prompt) -> samples
    unstable: dict[BenchConfig, list[int]] = {cfg: [] for cfg in configs}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompt_ids):  # interleaved: every config on prompt i, then i+1
            for cfg in configs:
                bar.set_postfix_str(f"pass {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompt_ids)} {cfg.name}")
                run = runners[cfg.system].run(cfg, ids)
                res = results[cfg]
                if rep == 0:
                    res.runs.append(run)
                    res.all_seconds.append([run.seconds])
                    res.best_pass.append(0)
                else:
                    res.all_seconds[i].append(run.seconds)
                    if run.seconds < res.runs[i].seconds:
                        res.runs[i].seconds, res.best_pass[i] = run.seconds, rep
                    if run.token_ids != res.runs[i].token_ids:
                        unstable[cfg].append(i)
                bar.update(1)
            bar.set_postfix_str(f"pass {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompt_ids)} forward costs")
            chunks[(rep, i)] = sampler.sample(args.cost_runs)
    bar.close()

    # Reference outputs and losslessness.
    sp_plain = results[BenchConfig("specray", "none")]
    hf_plain = results[BenchConfig("hf", "none")]
    mismatches = {}
    for cfg, res in results.items():
        vs_sp = [j for j, r in enumerate(res.runs) if r.token_ids != sp_plain.runs[j].token_ids]
        vs_hf = [j for j, r in enumerate(res.runs) if r.token_ids != hf_plain.runs[j].token_ids]
        lengths = [len(r.token_ids) for r in res.runs]
        mismatches[cfg] = {"vs_specray_plain": vs_sp, "vs_hf_plain": vs_hf,
                           "wrong_length": [j for j, n in enumerate(lengths) if n != args.max_tokens],
                           "differs_between_passes": sorted(set(unstable[cfg]))}

    # alpha (exact, teacher-forced along HF plain's greedy output) and the engine's k=1 rate.
    alpha = teacher_forced_alpha(hf_target, hf_draft, prompt_ids, [r.token_ids for r in hf_plain.runs])
    k1 = results.get(BenchConfig("specray", "draft", 1))
    alpha_k1 = k1.acceptance_rate if k1 is not None else None
    # c: medians over all forward-cost samples; prefill of each prompt for the decomposition.
    pooled: dict[tuple[str, int], list[float]] = {}
    for chunk in chunks.values():
        for case, ts in chunk.items():
            pooled.setdefault(case, []).extend(ts)
    costs = cost_table(pooled)
    target_ms, draft_ms = costs["target"][1], costs["draft"][1]
    c = draft_ms / target_ms
    prefill = {"target": [prefill_ms(engine.target, p) for p in prompt_ids],
               "draft": [prefill_ms(draft_runner, p) for p in prompt_ids]}
    chunk_costs = {key: cost_table(chunk) for key, chunk in chunks.items()}
    decomposition = _decompose(results, chunk_costs, prefill, alpha)

    rows = _rows(results, mismatches, alpha, c, sp_plain, hf_plain)
    summary = _summary(results, rows, alpha, alpha_k1, c, draft_ms, target_ms, pair)
    summary["forward_ms"] = costs
    summary["cost_samples"] = len(pooled[("target", 1)])
    summary["verify_cost_factor"] = {q: costs["target"][q] / target_ms for q in costs["target"]}
    total_mismatches = sum(len(m["vs_specray_plain"]) + len(m["vs_hf_plain"]) + len(m["wrong_length"])
                           + len(m["differs_between_passes"])
                           for cfg, m in mismatches.items() if cfg.system == "specray")
    hf_mismatches = sum(len(m["vs_hf_plain"]) for cfg, m in mismatches.items() if cfg.system == "hf")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = format_table(rows) + "\n\n" + format_decomposition(decomposition, costs)
    summary_text = format_summary(summary, args, total_mismatches, hf_mismatches)
    text = f"$ {command}\n\n{table}\n\n{summary_text}\n"
    print("\n" + table + "\n\n" + summary_text, flush=True)
    (out / "speed.txt").write_text(text)
    _write_csv(out / "speed.csv", rows)
    _plot(out / "speed.png", rows, summary, args)
    report = {
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_seconds": round(time.time() - started, 1),
        "settings": {"prompts": args.prompts, "max_tokens": args.max_tokens, "ks": args.ks,
                     "ngram_ks": args.ngram_ks, "seed": args.seed, "batch_size": 1, "greedy": True,
                     "ignore_eos": True, "torch_threads": 1, "max_matching_ngram_size": 2,
                     "order": "warm-up per config, then interleaved by prompt", "repeats": args.repeats,
                     "timing": "per (config, prompt): fastest of the passes",
                     "hf_assisted_defaults": _hf_assistant_defaults(hf_draft)},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "cpu_count": os.cpu_count(),
                        "loadavg_before": load_before, "loadavg_after": _loadavg(),
                        "platform": platform.platform()},
        "pair": dataclasses.asdict(pair),
        "prompt_token_lengths": [len(p) for p in prompt_ids],
        "summary": summary,
        "rows": rows,
        "step_decomposition": decomposition,
        "forward_ms_by_pass_and_prompt": {f"pass{p}-prompt{i}": v for (p, i), v in chunk_costs.items()},
        "prefill_ms": prefill,
        "total_mismatches": total_mismatches,
        "hf_mismatches_vs_hf_plain": hf_mismatches,
        "per_prompt": {
            cfg.name: {
                "seconds": [r.seconds for r in res.runs],
                "seconds_all_passes": res.all_seconds,
                "fastest_pass": res.best_pass,
                "tokens": [len(r.token_ids) for r in res.runs],
                "target_forwards": [r.target_forwards for r in res.runs],
                "spec_metrics": [r.metrics for r in res.runs] if cfg.system == "specray" else None,
                "warmup_seconds": res.warmup_seconds,
                "mismatches": mismatches[cfg],
            }
            for cfg, res in results.items()
        },
    }
    (out / "speed.json").write_text(json.dumps(report, indent=2, default=_json_default))
    print(f"\nwrote {out / 'speed.txt'}, speed.csv, speed.png, speed.json", flush=True)
    return report


def _rows(results, mismatches, alpha, c, sp_plain, hf_plain) -> list[dict]:
    base = sp_plain.tokens_per_s
    rows = []
    for cfg, res in results.items():
        bound = speedup_bound(alpha, cfg.k, c) if (cfg.system == "specray" and cfg.method == "draft") else None
        speedup = res.tokens_per_s / base
        rows.append({
            "config": cfg.name,
            "system": cfg.system,
            "method": cfg.method,
            "k": cfg.k if cfg.k is not None else "",
            "tokens": res.tokens,
            "seconds": round(res.seconds, 4),
            "tokens_per_s": round(res.tokens_per_s, 2),
            "speedup_vs_specray_plain": round(speedup, 3),
            "speedup_vs_hf_plain": round(res.tokens_per_s / hf_plain.tokens_per_s, 3),
            "mean_accepted_length": round(res.mean_accepted_length, 3),
            "acceptance_rate": _round(res.acceptance_rate, 3) if cfg.system == "specray" else "",
            "drafted_per_step": _round(res.drafted_per_step, 3) if cfg.system == "specray" else "",
            "tokens_per_target_forward": round(res.tokens_per_forward, 3),
            "bound": _round(bound, 3) if bound is not None else "",
            "measured_over_bound": _round(speedup / bound, 3) if bound else "",
            "mismatch_vs_specray_plain": len(mismatches[cfg]["vs_specray_plain"]),
            "mismatch_vs_hf_plain": len(mismatches[cfg]["vs_hf_plain"]),
            "wrong_length": len(mismatches[cfg]["wrong_length"]),
        })
    return rows


def _summary(results, rows, alpha, alpha_k1, c, draft_ms, target_ms, pair) -> dict:
    by_name = {r["config"]: r for r in rows}

    def tps(cfg: BenchConfig) -> float:
        return results[cfg].tokens_per_s

    sp_draft = [cfg for cfg in results if cfg.system == "specray" and cfg.method == "draft" and cfg.k != 1]
    sp_draft = sp_draft or [cfg for cfg in results if cfg.system == "specray" and cfg.method == "draft"]
    sp_ngram = [cfg for cfg in results if cfg.system == "specray" and cfg.method == "ngram"]
    best_draft = max(sp_draft, key=tps)
    best_ngram = max(sp_ngram, key=tps)
    hf_lookup = [cfg for cfg in results if cfg.system == "hf" and cfg.method == "ngram"]
    hf_same_k = BenchConfig("hf", "ngram", best_ngram.k)
    hf_best_lookup = max(hf_lookup, key=tps)
    hf_assisted = BenchConfig("hf", "draft")
    draft_bound_fracs = {cfg.name: by_name[cfg.name]["measured_over_bound"] for cfg in sp_draft}
    return {
        "alpha_teacher_forced": alpha,
        "alpha_engine_k1": alpha_k1,
        "alpha_demo_metrics": pair.alpha,
        "cost_ratio_c": c,
        "cost_ratio_demo_metrics": pair.cost_ratio,
        "draft_step_ms": draft_ms,
        "target_step_ms": target_ms,
        "specray_plain_tps": tps(BenchConfig("specray", "none")),
        "hf_plain_tps": tps(BenchConfig("hf", "none")),
        "best_specray_draft": best_draft.name,
        "best_specray_ngram": best_ngram.name,
        "ratio_specray_plain_over_hf_plain": tps(BenchConfig("specray", "none")) / tps(BenchConfig("hf", "none")),
        "ratio_best_draft_over_hf_assisted": tps(best_draft) / tps(hf_assisted),
        "ratio_best_ngram_over_hf_lookup_same_k": tps(best_ngram) / tps(hf_same_k),
        "ratio_best_ngram_over_hf_best_lookup": tps(best_ngram) / tps(hf_best_lookup),
        "hf_best_lookup": hf_best_lookup.name,
        "measured_over_bound": draft_bound_fracs,
        "goals": {
            "draft_speedup_ge_0.9_bound": {
                name: (frac != "" and frac >= GOAL_BOUND_FRACTION) for name, frac in draft_bound_fracs.items()
            },
            "best_draft_ge_1.3_hf_assisted": tps(best_draft) / tps(hf_assisted) >= GOAL_VS_HF,
            "best_ngram_ge_1.3_hf_lookup_same_k": tps(best_ngram) / tps(hf_same_k) >= GOAL_VS_HF,
        },
    }


def _decompose(results, chunk_costs, prefill, alpha) -> list[dict]:
    """Per specray config: where a decode step's time goes, by the runners' own costs.

    steps = target forwards after the prefill; decode ms/step = (wall - prefill) / steps;
    model ms/step = target forward at the mean verify width (1 + draft tokens per step)
    + one draft forward per draft token (q=1), with each prompt's forward costs taken from
    the samples right after the pass its (fastest) time came from; overhead = the rest:
    proposer host code, tensor building outside the runners, accept, commit,
    detokenization, outputs (and cache effects the tight cost loop does not see).
    """
    out = []
    for cfg, res in results.items():
        if cfg.system != "specray":
            continue
        steps_i = [r.target_forwards - 1 for r in res.runs]
        steps = sum(steps_i)
        if steps <= 0:
            continue
        t = res.spec_totals()
        drafted = t["num_draft_tokens"] / steps
        model_total = 0.0
        for i, n in enumerate(steps_i):
            table = chunk_costs[(res.best_pass[i], i)]
            step_ms = interp(table["target"], 1 + drafted)
            if cfg.method == "draft":
                step_ms += drafted * table["draft"][1]
            model_total += n * step_ms
        model_ms = model_total / steps
        pre = sum(prefill["target"]) + (sum(prefill["draft"]) if cfg.method == "draft" else 0.0)
        decode_ms = (res.seconds * 1e3 - pre) / steps
        tok_step = sum(len(r.token_ids) - 1 for r in res.runs) / steps
        iid = speedup_bound(alpha, cfg.k, 0.0) if cfg.method == "draft" else None  # c = 0: tokens per step
        out.append({
            "config": cfg.name,
            "steps": steps,
            "tokens_per_step": round(tok_step, 3),
            "iid_tokens_per_step": _round(iid, 3) if iid is not None else "",
            "draft_tokens_per_step": round(drafted, 3),
            "decode_ms_per_step": round(decode_ms, 3),
            "model_ms_per_step": round(model_ms, 3),
            "overhead_ms_per_step": round(decode_ms - model_ms, 3),
            "overhead_pct": round(100 * (decode_ms - model_ms) / decode_ms, 1),
            "prefill_ms_total": round(pre, 2),
        })
    return out


DECOMP_COLUMNS = [
    ("config", "config", "<"),
    ("steps", "steps", ">"),
    ("tokens_per_step", "tok/step", ">"),
    ("iid_tokens_per_step", "iid tok/step", ">"),
    ("draft_tokens_per_step", "drafted/step", ">"),
    ("decode_ms_per_step", "ms/step", ">"),
    ("model_ms_per_step", "model ms", ">"),
    ("overhead_ms_per_step", "overhead ms", ">"),
    ("overhead_pct", "overhead %", ">", 1),
]


def format_decomposition(rows: list[dict], costs: dict) -> str:
    title = ("per-step time of specray configs (ms/step = (wall - prefill) / steps; model ms = the runners' own "
             "forward costs, sampled after each prompt round: target at the mean verify width + one draft forward "
             "per draft token; overhead = everything else)")
    t = " ".join(f"q={q}:{ms:.3f}" for q, ms in sorted(costs["target"].items()))
    d = " ".join(f"q={q}:{ms:.3f}" for q, ms in sorted(costs["draft"].items()))
    return (f"{title}\n{_aligned(rows, DECOMP_COLUMNS)}\n"
            f"runner.forward ms (median of all samples, 128-token cache), target: {t}; draft: {d}")


# -- output ------------------------------------------------------------------------------
TABLE_COLUMNS = [
    ("config", "config", "<"),
    ("tokens_per_s", "tok/s", ">"),
    ("speedup_vs_specray_plain", "x sp-plain", ">"),
    ("speedup_vs_hf_plain", "x hf-plain", ">"),
    ("mean_accepted_length", "acc.len", ">"),
    ("drafted_per_step", "drafted", ">"),
    ("acceptance_rate", "acc.rate", ">"),
    ("tokens_per_target_forward", "tok/fwd", ">"),
    ("bound", "bound", ">"),
    ("measured_over_bound", "meas/bound", ">"),
    ("mismatch_vs_specray_plain", "mism sp", ">"),
    ("mismatch_vs_hf_plain", "mism hf", ">"),
]


def format_table(rows: list[dict]) -> str:
    return _aligned(rows, TABLE_COLUMNS)


def _aligned(rows: list[dict], columns) -> str:
    cells = [[_fmt(r[col[0]], *col[3:]) for col in columns] for r in rows]
    heads = [col[1] for col in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(values):
        return "  ".join(v.ljust(w) if col[2] == "<" else v.rjust(w)
                         for v, w, col in zip(values, widths, columns)).rstrip()

    out = [line(heads), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    return "\n".join(out)


def format_summary(s: dict, args, total_mismatches: int, hf_mismatches: int) -> str:
    def yn(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    g = s["goals"]
    lines = [
        f"alpha (teacher-forced along the target's greedy output) = {s['alpha_teacher_forced']:.4f}; "
        f"engine draft k=1 acceptance = {_fmt(s['alpha_engine_k1'], 4)}; demo metrics.json = {s['alpha_demo_metrics']:.4f}",
        f"c (ModelRunner.forward, 1 token, batch 1, median of {s['cost_samples']}) = {s['cost_ratio_c']:.4f} "
        f"(draft {s['draft_step_ms']:.3f} ms / target {s['target_step_ms']:.3f} ms); "
        f"demo metrics.json (HF forward) = {s['cost_ratio_demo_metrics']:.4f}",
        f"bound = (1 - a^(k+1)) / ((1 - a)(k c + 1)) with a = teacher-forced alpha; "
        f"acc.len = 1 + accepted/drafts for specray, tokens per decode step for HF; "
        f"drafted = draft tokens offered per drafting step; tok/fwd = tokens per target forward (prefill included)",
        f"specray plain / HF plain           = {s['ratio_specray_plain_over_hf_plain']:.3f}",
        f"best specray draft ({s['best_specray_draft']}) / HF assisted (default) = "
        f"{s['ratio_best_draft_over_hf_assisted']:.3f}   goal >= {GOAL_VS_HF}: {yn(g['best_draft_ge_1.3_hf_assisted'])}",
        f"best specray ngram ({s['best_specray_ngram']}) / HF prompt lookup same k = "
        f"{s['ratio_best_ngram_over_hf_lookup_same_k']:.3f}   goal >= {GOAL_VS_HF}: "
        f"{yn(g['best_ngram_ge_1.3_hf_lookup_same_k'])}"
        f"   (vs HF's best, {s['hf_best_lookup']}: {s['ratio_best_ngram_over_hf_best_lookup']:.3f})",
    ]
    for name, frac in s["measured_over_bound"].items():
        lines.append(f"{name}: measured / bound = {_fmt(frac)}   goal >= {GOAL_BOUND_FRACTION}: "
                     f"{yn(g['draft_speedup_ge_0.9_bound'][name])}")
    lines.append(f"token mismatches of specray configs (vs specray plain, vs HF plain, wrong length): "
                 f"{total_mismatches}" + ("" if total_mismatches == 0 else "  <-- NOT LOSSLESS"))
    lines.append(f"HF configs differing from HF plain: {hf_mismatches}")
    lines.append(f"{args.prompts} held-out prompts x {args.max_tokens} new tokens, batch 1, greedy, "
                 f"EOS ignored, torch threads 1; each (config, prompt) timed {args.repeats}x, fastest kept")
    return "\n".join(lines)


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _plot(path: Path, rows: list[dict], summary: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    values = [r["tokens_per_s"] for r in rows]
    colors = [{("specray", "none"): "#4c72b0", ("specray", "draft"): "#55a868", ("specray", "ngram"): "#8172b2",
               ("hf", "none"): "#937860", ("hf", "draft"): "#c44e52", ("hf", "ngram"): "#dd8452"}
              [(r["system"], r["method"])] for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(rows) + 2), 5.5))
    x = range(len(rows))
    ax.bar(x, values, color=colors)
    base = summary["specray_plain_tps"]
    bx = [i for i, r in enumerate(rows) if r["bound"] != ""]
    if bx:
        ax.scatter(bx, [rows[i]["bound"] * base for i in bx], marker="_", s=600, color="black", linewidths=2.5,
                   zorder=3, label="bound x specray plain (1-a^(k+1))/((1-a)(kc+1))")
        ax.legend(loc="upper left", fontsize=8)
    ax.axhline(base, color="#4c72b0", lw=0.8, ls="--")
    for i, v in enumerate(values):
        ax.text(i, v * 0.98, f"{v:.0f}", ha="center", va="top", fontsize=7, color="white")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("tokens / s (batch 1, greedy)")
    ax.set_title(f"demo pair, {args.prompts} prompts x {args.max_tokens} tokens, 1 thread   "
                 f"alpha={summary['alpha_teacher_forced']:.3f}  c={summary['cost_ratio_c']:.3f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hf_assistant_defaults(draft) -> dict:
    """The assistant settings HF's AssistedCandidateGenerator will use (its own copy of the
    draft's generation config, filled with HF's global defaults)."""
    import copy

    gc = copy.deepcopy(draft.generation_config)
    try:
        gc.update(**gc._get_default_generation_params(), defaults_only=True)
    except Exception:  # private API; informational only
        pass
    try:
        import sklearn  # noqa: F401

        adaptive = True
    except ImportError:
        adaptive = False
    return {
        "num_assistant_tokens": getattr(gc, "num_assistant_tokens", None),
        "num_assistant_tokens_schedule": getattr(gc, "num_assistant_tokens_schedule", None),
        "assistant_confidence_threshold": getattr(gc, "assistant_confidence_threshold", None),
        "threshold_adapts_by_roc": adaptive,
    }


def _fmt(v, digits: int = 3) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def _round(v, digits):
    return v if v is None or (isinstance(v, float) and math.isnan(v)) else round(v, digits)


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _json_default(o):
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
