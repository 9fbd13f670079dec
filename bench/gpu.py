"""The step against the memory-bandwidth bound, on a GPU, with nothing to download.

    python -m specray.bench.gpu                      # any CUDA machine: synthetic 8B-shaped pair, bf16
    python -m specray.bench.gpu --device cpu         # the same benchmark on the CPU, demo pair

The pair (CUDA default) is SYNTHETIC and labelled so everywhere it is printed: a
Llama-3-8B-shaped target (hidden 4096, 32 layers, GQA 32/8, FFN 14336, vocab 32000) with
random weights, built on the GPU in bf16, and a draft made of the target's first
``--draft-layers`` layers with the same embedding, final norm and LM head (shared, no extra
memory); the target's later layers have their residual writes (``o_proj``, ``down_proj``)
scaled by ``--scale``, which sets how often the draft agrees with it (0.03: about 0.75,
teacher-forced). Cost is real, outputs are not language. On the CPU the default pair is the
trained demo pair instead (``--shape tiny`` builds a small synthetic one anywhere).

Side by side in one process, greedy, EOS ignored, ``--max-tokens`` per request, at each
``--batch``: specray ``none``, ``draft`` k=4, ``draft`` with the self-tuning speculation length,
``ngram`` k=4, in each ``--modes`` step mode (``engine/graphs.py``), and HF ``generate`` eager and
with its static cache (which compiles itself on CUDA; ``compiled``: a static cache and
``torch.compile(model.forward)``, HF's own compiled path, what it takes on a CPU). The
``--prompts`` prompts run ``--batch`` at a time (batch 1: one after another); on the CPU with the
demo pair they are held-out demo prompts of ``--prompt-len`` tokens (default 20-30), elsewhere
random ones. Each row's first pass is a warm-up (compilation, captures), timed and printed apart
(``warm s``). Then ``--repeats`` rounds time every row once each, interleaved: a row's times are
its median round's, and every ratio (to HF, to eager, to plain) is the median of the rounds'
side-by-side ratios, so that a shared machine's drift falls on both sides of each.
Reported per row: ms per token (the request's wall time / tokens; prefill included), tokens/s, the fraction of the bandwidth
bound (weights bytes / measured device copy bandwidth, per token of one sequence), the ratio
to HF static, accepted tokens per step, for draft rows the Leviathan bound
(1 - a^(k+1)) / ((1 - a)(k c + 1)) with measured alpha (teacher-forced) and c (one-token
forward times) and measured/bound, and where a step's time goes: on CUDA, from torch.profiler
over ``--profile-steps`` steps, device-busy time per step against wall time (host share =
1 - busy / wall), kernel and graph launches and device-to-host copies per step; on the CPU,
host reads of tensors per step (``bench/probes.py``) and, for compiled rows, the host share of a
step: its wall time minus the time inside the compiled callables (``policies/compiled.py``),
timed around them (the median of ``HOST_WINDOWS`` windows); and greedy agreement with plain decoding
(bf16 random weights make logits flat, so differently shaped computations may diverge there:
``--dtype float32`` checks identity).

Writes ``gpu.txt`` (the table, the goals of issue 28 and the profile summary), ``gpu.csv``,
``gpu.json`` and ``gpu.png`` to ``--out`` (default ``./specray-bench/gpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import logging
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from specray.bench.probes import host_reads, profile_steps
from specray.bench.speed import _aligned, speedup_bound
from specray.engine.graphs import CAPTURED, COMPILED
from specray.policies.compiled import timing

log = logging.getLogger(__name__)

PROG = "python -m specray.bench.gpu"
SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}
CONFIGS = {  # name -> speculation
    "none": {"method": "none"},
    "draft k=4": {"method": "draft", "num_speculative_tokens": 4},
    "draft auto": {"method": "draft"},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
}
K_OF = {"draft k=4": 4}


# -- the pair -------------------------------------------------------------------------------
def synthetic_pair(shape: str, draft_layers: int, scale: float, dtype: torch.dtype, device: str, seed: int = 0):
    """(target, draft): random weights at a real shape; the draft shares the target's first
    layers, embedding, norm and head; later target layers write ``scale`` x their residual."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            target = LlamaForCausalLM(cfg).eval()
            dcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": draft_layers})
            with torch.device("meta"):
                draft = LlamaForCausalLM(dcfg).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for layer in target.model.layers[draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.layers = torch.nn.ModuleList(target.model.layers[:draft_layers])
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    with torch.device(device):
        draft.model.rotary_emb = LlamaRotaryEmbedding(config=dcfg)
    return target, draft


def demo_pair(dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    from specray.demo import load_or_build_demo_pair

    pair = load_or_build_demo_pair()
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()  # noqa: E731
    return load(pair.target), load(pair.draft)


def demo_prompts(n: int, lengths: tuple[int, int]) -> list[list[int]]:
    """``n`` held-out demo prompts of lengths[0]..lengths[1] tokens, spread over the range:
    longer held-out prompts (whole lines) cut to length (short runs of whole lines are
    mostly found in the training text too)."""
    from transformers import AutoTokenizer

    from specray.demo import held_out_prompts, load_or_build_demo_pair

    low, high = lengths
    tokenizer = load_or_build_demo_pair().tokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer)
    texts = held_out_prompts(n, tokenizer, min_tokens=max(32, high), max_tokens=max(256, 2 * high))
    return [tok.encode(t, add_special_tokens=False)[: low + (i * (high - low + 1)) // n] for i, t in enumerate(texts)]


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts whose second half repeats the first (prompt lookup finds matches)."""
    g = torch.Generator().manual_seed(seed)
    half = max(1, length // 2)
    out = []
    for _ in range(n):
        first = torch.randint(0, vocab, (half,), generator=g).tolist()
        out.append((first + first)[:length])
    return out


@contextlib.contextmanager
def hf_attention(*models):
    """Run the models with HF's own SDPA attention (specray's runner installs its own)."""
    saved = [m.config._attn_implementation for m in models]
    for m in models:
        m.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for m, name in zip(models, saved):
            m.set_attn_implementation(name)


# -- measurements ----------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 25)  # 1 GiB / 128 MiB of float32
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n * 4 / min(times[1:])


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed(fn, device: str, repeats: int = 1):
    """The fastest of ``repeats`` runs (shared CPU cores: other jobs only ever slow a run
    down) and the last run's output."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def run_specray(engine, prompts, max_tokens: int, spec):
    from specray.engine import SamplingParams, SpeculationParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return engine.generate(prompts, params, SpeculationParams(**spec))


def run_hf(model, prompts, max_tokens: int, static: bool, max_cache_len: int | None = None):
    """Greedy ``generate``; ``static``: HF's static cache, sized ``max_cache_len`` for every call.

    A fixed size matters for the compiled row: HF keeps one static cache across calls and
    reallocates it when a call needs more, and a cache of another size fails the compiled
    graphs' guards, so each prompt length would recompile in the timed runs."""
    width = max(map(len, prompts))
    pad = model.config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kw = {"cache_implementation": "static", "max_cache_len": max_cache_len} if static else {}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=pad, **kw)
    return out[:, width:].tolist()


@contextlib.contextmanager
def hf_compiled(model, compiled):
    """HF's compiled path as a user takes it on a CPU: a static cache and the model's forward
    under ``torch.compile(dynamic=False, fullgraph=True)`` (``compiled``, made once: one graph
    per prefill length, and one for decoding)."""
    import torch._dynamo

    forward, limit = model.forward, torch._dynamo.config.cache_size_limit
    torch._dynamo.config.cache_size_limit = 64  # a graph per prompt length
    model.forward = compiled
    try:
        yield
    finally:
        model.forward, torch._dynamo.config.cache_size_limit = forward, limit


def _compiles() -> tuple[int, int]:
    """(graphs compiled, recompiles) so far in this process (dynamo's counters)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())


def batches(prompts, b: int):
    """The prompts ``b`` at a time (batch 1: one after another)."""
    return [prompts[i : i + b] for i in range(0, len(prompts), b)]


def teacher_forced_alpha(target, draft, prompts, continuations) -> float:
    """Fraction of the target's greedy continuation where the draft's argmax agrees."""
    matches = total = 0
    with torch.inference_mode(), hf_attention(target, draft):
        for prompt, cont in zip(prompts, continuations):
            ids = torch.tensor([prompt + cont], device=target.device)
            keep = len(cont) + 1
            t_pred = target(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1)
            d_pred = draft(input_ids=ids, logits_to_keep=keep).logits[0, :-1].argmax(-1)
            matches += int((t_pred == d_pred).sum())
            total += len(cont)
    return matches / total if total else float("nan")


def forward_ms(runner, device: str, repeats: int = 20) -> float:
    """Median ms of a one-token forward at batch 1 after a short prefix (the runner's own path)."""
    runner.set_length(0, 0)
    runner.forward([0], [[1] * 16])
    times = []
    for _ in range(repeats):
        runner.set_length(0, 16)
        if runner.static is not None:
            dt, _ = timed(lambda: runner.static.run([0], [[1]]), device)
        else:
            dt, _ = timed(lambda: runner.forward([0], [[1]]), device)
        times.append(dt)
    runner.set_length(0, 0)
    return 1e3 * statistics.median(times[2:])


HOST_WINDOWS = 5  # windows the host share is the median of: one window of 16 steps moves with a shared core's moment


def profile_tokens(steps: int) -> int:
    """Tokens a profiled request may emit: never done early (six a step, the longest window)."""
    return 4 * steps * 6 + 16


def step_profile(engine, prompts, spec, steps: int, device: str) -> dict:
    """Where a decode step's time goes (requests admitted first, then ``steps`` steps). The
    compiled rows' host share is the median of ``HOST_WINDOWS`` windows of ``steps`` steps,
    each on requests admitted afresh (the same contexts every window)."""
    from specray.engine import SamplingParams, SpeculationParams

    long = SamplingParams(max_tokens=profile_tokens(steps), temperature=0, ignore_eos=True)

    def admitted() -> list[str]:
        ids = [engine.add_request(p, long, SpeculationParams(**spec)) for p in prompts]
        engine.step()
        engine.step()  # admitted, and one step for lazy captures
        return ids

    ids = admitted()
    out = {}
    dt, _ = timed(lambda: [engine.step() for _ in range(steps)], device)
    out["wall_ms"] = 1e3 * dt / steps
    if device.startswith("cuda"):
        prof = profile_steps(engine.step, steps)
        out.update(prof)
        out["host_share"] = max(0.0, 1 - prof["device_ms"] / out["wall_ms"])
    else:
        reads = []
        for _ in range(steps):
            with host_reads() as n:
                engine.step()
            reads.append(n["reads"])
        out["reads"] = max(reads)
    if engine.step_mode in COMPILED:  # wall time minus the time inside compiled callables
        inside, shares = [], []
        for _ in range(HOST_WINDOWS):
            for rid in ids:
                engine.abort(rid)
            ids = admitted()
            with timing() as clock:
                start = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                wall = time.perf_counter() - start
            inside.append(clock.seconds)
            shares.append(max(0.0, 1 - clock.seconds / wall))
        out["compiled_ms"] = 1e3 * statistics.median(inside) / steps
        out["host_share"] = statistics.median(shares)
    for rid in ids:
        engine.abort(rid)
    return out


# -- the benchmark ---------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16, float32")
    p.add_argument("--shape", default="auto", choices=["auto", "demo", *SHAPES],
                   help="the pair: auto (llama3-8b on CUDA, demo on CPU), demo (the trained demo pair), or a synthetic shape")
    p.add_argument("--draft-layers", type=int, default=2, help="synthetic draft: the target's first N layers")
    p.add_argument("--scale", type=float, default=0.03, help="synthetic: later layers' residual scale (sets alpha)")
    p.add_argument("--batch", default="auto", help="batch sizes (auto: 1,8,32 on CUDA, 1,8 on CPU)")
    p.add_argument("--prompts", type=int, default=None, help="prompts, run --batch at a time (default: the largest batch)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--prompt-len", default="auto",
                   help="prompt tokens: N, or MIN-MAX for held-out demo prompts (auto: 20-30 with the demo pair, else 64)")
    p.add_argument("--modes", default="auto", help="step modes: auto (graphs on CUDA; eager,compile on CPU)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"specray configs, of: {', '.join(CONFIGS)}")
    p.add_argument("--hf", default="auto", help="HF baselines: eager, static, compiled (a static cache and a compiled "
                   "forward), none (auto: eager,static on CUDA, eager,compiled on CPU)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed rounds, every row once a round (its median round kept; ratios: medians of the rounds' ratios)")
    p.add_argument("--profile-steps", type=int, default=16, help="steps profiled per row (0: no profile)")
    p.add_argument("--out", default="specray-bench/gpu", help="output folder")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"
    if args.shape == "auto":
        args.shape = "llama3-8b" if cuda else "demo"
    if args.modes == "auto":
        args.modes = "graphs" if cuda else "eager,compile"
    if args.hf == "auto":
        args.hf = "eager,static" if cuda else "eager,compiled"
    if args.batch == "auto":
        args.batch = "1,8,32" if cuda else "1,8"
    if args.prompt_len == "auto":
        args.prompt_len = "20-30" if args.shape == "demo" else "64"
    low, _, high = args.prompt_len.partition("-")
    args.prompt_lengths = (int(low), int(high or low))
    args.batches = [int(b) for b in args.batch.split(",")]
    args.prompts = args.prompts or max(args.batches)
    args.mode_list = [m for m in args.modes.split(",") if m]
    args.config_list = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.config_list if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    args.hf_list = [h for h in args.hf.split(",") if h and h != "none"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1) if args.device == "cpu" else None  # small models on shared cores
    logging.basicConfig(level=logging.WARNING)
    command = " ".join([PROG, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    device, dtype = args.device, getattr(torch, args.dtype)
    synthetic = args.shape != "demo"
    label = (f"SYNTHETIC pair ({args.shape} shape, random weights, draft = first {args.draft_layers} layers, "
             f"scale {args.scale})" if synthetic else "demo pair (trained on the Python stdlib)")
    t0 = time.perf_counter()
    target, draft = (synthetic_pair(args.shape, args.draft_layers, args.scale, dtype, device) if synthetic
                     else demo_pair(dtype, device))
    print(f"{label}: built in {time.perf_counter() - t0:.1f} s; {args.dtype} on {device}", flush=True)
    vocab = target.config.vocab_size
    if synthetic:
        prompts = make_prompts(args.prompts, args.prompt_lengths[1], vocab)
    else:
        prompts = demo_prompts(args.prompts, args.prompt_lengths)
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} new tokens each", flush=True)
    bw = copy_bandwidth(device)
    bound_ms = 1e3 * weight_bytes(target) / bw  # one sequence reads every weight once per token
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; weights {weight_bytes(target) / 1e9:.2f} GB; "
          f"bound {bound_ms:.2f} ms/token", flush=True)

    # Every row is built and warmed first, then timed in interleaved rounds (each row once a
    # round): a ratio is taken within a round, its rows side by side under the same load, and
    # the median of the rounds' ratios is reported. On shared cores a machine's speed drifts
    # by tens of percent over minutes, and rows timed one after another compared different
    # moments (one run's plain compile / HF eager read 2.2x, the next one's 3.0x).
    alpha = c = None
    compile_s = {}  # step mode -> the engine's warm-up (compile) seconds
    engines, rows, timers = {}, [], []
    for mode in args.mode_list:
        from specray.engine import EngineConfig, LLMEngine

        longest = max(map(len, prompts))
        engine = engines[mode] = LLMEngine(
            EngineConfig(target="synthetic" if synthetic else "demo", max_num_seqs=max(args.batches),
                         max_model_len=longest + max(args.max_tokens, profile_tokens(args.profile_steps)) + 8,
                         step=mode, dtype=args.dtype, device=device),
            target_model=target, draft_model=draft)
        if engine.warmup_seconds is not None:
            print(f"  {mode}: the engine compiled its step in {engine.warmup_seconds:.1f} s (warm-up)", flush=True)
            compile_s[mode] = engine.warmup_seconds
        if c is None:
            c = forward_ms(engine.resources["draft"], device) / forward_ms(engine.target, device)
        for b in args.batches:
            groups = batches(prompts, b)
            for name in args.config_list:
                spec = CONFIGS[name]

                def run(engine=engine, groups=groups, spec=spec):
                    return [o for g in groups for o in run_specray(engine, g, args.max_tokens, spec)]

                start = time.perf_counter()
                # warm-up: compiles, and under CUDA graphs a capture per (batch, width, kv block),
                # so there every length the timed runs reach
                warm = args.max_tokens if mode in CAPTURED else min(16, args.max_tokens)
                for group in groups:
                    run_specray(engine, group, warm, spec)
                rows.append({"config": f"specray {name}", "mode": mode, "batch": b, "runs": len(groups),
                             "warm_s": time.perf_counter() - start, "spec": spec})
                timers.append(run)

    ceiling = max(map(len, prompts)) + args.max_tokens  # one static cache size for every HF call
    compiled_forward = torch.compile(target.forward, dynamic=False, fullgraph=True) if "compiled" in args.hf_list else None
    # HF baselines, warmed after the engines are built (nothing of theirs may recompile a
    # baseline's graphs in a timed round)
    hf_rows, hf_timers = [], []
    for kind in args.hf_list:
        for b in args.batches:
            groups = batches(prompts, b)

            def run(kind=kind, groups=groups, max_tokens=args.max_tokens):
                with hf_attention(target), (hf_compiled(target, compiled_forward) if kind == "compiled"
                                            else contextlib.nullcontext()):
                    return [t for g in groups for t in run_hf(target, g, max_tokens, kind != "eager", ceiling)]

            # warm-up: the compiled path compiles per shape (each prompt length, the cache's)
            start = time.perf_counter()
            run(groups=groups if kind != "eager" else groups[:1], max_tokens=8 if kind == "eager" else args.max_tokens)
            hf_rows.append({"config": f"hf {kind}", "mode": "-", "batch": b, "runs": len(groups),
                            "warm_s": time.perf_counter() - start})
            hf_timers.append(run)

    rows, timers = hf_rows + rows, hf_timers + timers
    graphs_before = _compiles()
    for rnd in range(args.repeats):  # the timed rounds
        for row, run in zip(rows, timers):
            sync(device)
            start = time.perf_counter()
            out = run()
            sync(device)
            row.setdefault("rounds_s", []).append(time.perf_counter() - start)
            row["out"] = out
            if rnd == args.repeats - 1:
                print(_progress(_row(row, args, bound_ms)), flush=True)
    if _compiles() != graphs_before:  # a compile inside a timed run would be counted as its time
        print(f"WARNING: torch compiled during the timed rounds ({graphs_before} -> {_compiles()} graphs/recompiles)")

    for row in rows:  # tokens, and what a step accepted
        out = row.pop("out")
        specray = row["config"].startswith("specray")
        row["tokens"] = [o.token_ids for o in out] if specray else out
        if specray:
            steps = sum(o.metrics["target_forward_passes"] for o in out) / len(out)
            row["accepted"] = args.max_tokens / max(steps, 1)
    for row in rows:  # each specray row against plain decoding in its mode, at its batch
        plain = next((r for r in rows if r["config"] == "specray none" and r["mode"] == row["mode"]
                      and r["batch"] == row["batch"]), None)
        if row["config"].startswith("specray") and plain is not None:
            row["plain"] = plain["tokens"]
            if row is plain and alpha is None and row["batch"] == min(args.batches):
                alpha = teacher_forced_alpha(target, draft, prompts, row["tokens"])
    for i, row in enumerate(rows):
        spec = row.pop("spec", None)
        rows[i] = _row(row, args, bound_ms)
        if spec is not None and args.profile_steps:
            rows[i].update(step_profile(engines[row["mode"]], prompts[: row["batch"]], spec, args.profile_steps, device))
    engines.clear()
    _finish(rows, alpha, c)
    summary = {"pair": label, "device": _device_name(device), "dtype": args.dtype, "bandwidth_GBps": bw / 1e9,
               "weights_GB": weight_bytes(target) / 1e9, "bound_ms_per_token": bound_ms, "alpha": alpha, "c": c,
               "command": command, "host": platform.node(), "compile_s": compile_s, "load": _load(),
               "rounds": args.repeats}
    _write(Path(args.out), rows, summary)
    return 0


def _row(row: dict, args, bound_ms) -> dict:
    """A table row from a timed one: ``rounds_s`` holds each round's wall time for the row's
    ``runs`` batches together; its times are the median round's."""
    seconds = statistics.median(row["rounds_s"])
    ms = 1e3 * seconds / (args.max_tokens * row["runs"])
    out = {"config": row["config"], "mode": row["mode"], "batch": row["batch"], "ms_per_token": ms,
           "tok_s": args.prompts * args.max_tokens / seconds, "of_bound": bound_ms / ms,
           "accepted_per_step": row.get("accepted"), "warm_s": row["warm_s"], "rounds_s": row["rounds_s"]}
    tokens, plain = row.get("tokens"), row.get("plain")
    if tokens is not None and plain is not None:
        same = sum(t == p for t, p in zip(tokens, plain))
        out["agree_rows"] = f"{same}/{len(tokens)}"
    return out


def _finish(rows: list[dict], alpha, c) -> None:
    """Ratios to HF compiled or static (or eager) at the same batch, to HF eager, to the
    config's eager run and to plain decoding in its mode — each the median of the rounds'
    side-by-side ratios (every row makes the same tokens) — and the Leviathan bound for
    draft rows."""
    def find(config, batch, mode="-"):
        return next((h for h in rows if h["batch"] == batch and h["config"] == config and h["mode"] == mode), None)

    def ratio(r, base):
        return statistics.median(b / s for b, s in zip(base["rounds_s"], r["rounds_s"])) if base else None

    for r in rows:
        r["x_hf"] = ratio(r, find("hf compiled", r["batch"]) or find("hf static", r["batch"]) or find("hf eager", r["batch"]))
        r["x_hf_eager"] = ratio(r, find("hf eager", r["batch"]))
        eager = find(r["config"], r["batch"], "eager") if r["config"].startswith("specray") else None
        r["x_eager"] = ratio(r, eager) if r["mode"] != "eager" else None
        plain = next((p for p in rows if p["batch"] == r["batch"] and p["mode"] == r["mode"]
                      and p["config"] == "specray none"), None)
        r["x_plain"] = ratio(r, plain)
        k = K_OF.get(r["config"].removeprefix("specray "))
        if k and alpha is not None and c is not None:
            r["leviathan"] = speedup_bound(alpha, k, c)
            r["of_leviathan"] = r["x_plain"] / r["leviathan"] if r["x_plain"] else None


COLUMNS = [  # (key, heading, align, digits)
    ("config", "config", "<"), ("mode", "mode", "<"), ("batch", "batch", ">"), ("ms_per_token", "ms/token", ">", 2),
    ("tok_s", "tok/s", ">", 1), ("of_bound", "of bound", ">", 2), ("x_plain", "x plain", ">", 2),
    ("x_hf", "x HF", ">", 2), ("x_hf_eager", "x HF eager", ">", 2), ("x_eager", "x eager", ">", 2),
    ("warm_s", "warm s", ">", 1), ("accepted_per_step", "tok/step", ">", 2), ("leviathan", "Leviathan", ">", 2),
    ("of_leviathan", "of Lev.", ">", 2), ("wall_ms", "step ms", ">", 2), ("device_ms", "busy ms", ">", 2),
    ("compiled_ms", "compiled ms", ">", 2), ("host_share", "host", ">", 2), ("launches", "launch/step", ">", 0), ("graph_launches", "graphs/step", ">", 0),
    ("d2h_copies", "D2H/step", ">", 1), ("reads", "reads/step", ">", 0), ("agree_rows", "= plain", ">"),
]


def _progress(r: dict) -> str:
    return f"  {r['config']:<18} {r['mode']:<8} batch {r['batch']:>3}: {r['tok_s']:8.1f} tok/s, {r['ms_per_token']:.2f} ms/token"


def _load() -> str:
    """The machine's load average over 1, 5, 15 minutes (shared CPU machines)."""
    import os

    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"


def _write(out: Path, rows: list[dict], summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    columns = [c for c in COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    for r in rows:
        for c in columns:
            r.setdefault(c[0], None)
    head = [f"{summary['pair']} on {summary['device']}, {summary['dtype']}",
            f"bound: {summary['weights_GB']:.2f} GB of weights / {summary['bandwidth_GBps']:.0f} GB/s copy = "
            f"{summary['bound_ms_per_token']:.2f} ms/token; alpha {_f(summary['alpha'])} (teacher-forced), "
            f"c {_f(summary['c'])}", f"command: {summary['command']}",
            "compile (engine warm-up, apart from the timings): "
            + (", ".join(f"{m} {s:.1f} s" for m, s in summary["compile_s"].items()) or "none")
            + f"; load average {summary['load']}",
            f"timed: {summary['rounds']} interleaved round(s), every row once a round; times: the median round; "
            f"ratios: the median of the rounds' side-by-side ratios"]
    table = "\n".join(head) + "\n\n" + _aligned(rows, columns) + "\n\n" + goals(rows)
    print("\n" + table)
    (out / "gpu.txt").write_text(table + "\n")
    with open(out / "gpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c[0] for c in columns], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "gpu.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1, default=str))
    _plot(out / "gpu.png", rows, summary)
    print(f"\nwrote {out}/gpu.txt, gpu.csv, gpu.json, gpu.png")


def goals(rows: list[dict]) -> str:
    """Issue 28's goals at batch 1, as this run measured them (lines for the rows present)."""
    def get(config, mode, batch=1):
        return next((r for r in rows if r["config"] == config and r["mode"] == mode and r["batch"] == batch), None)

    lines = ["goals (batch 1):"]
    plain, draft = get("specray none", "compile"), get("specray draft k=4", "compile")
    hf_eager, hf_compiled = get("hf eager", "-"), get("hf compiled", "-")
    draft_eager = get("specray draft k=4", "eager")
    if plain and hf_eager:
        x = plain["x_hf_eager"]
        lines.append(f"  specray plain compile / HF eager      {x:5.2f}  (goal >= 2.5: {'met' if x >= 2.5 else 'NOT met'})")
    if plain and hf_compiled:
        x = plain["x_hf"]
        lines.append(f"  specray plain compile / HF compiled   {x:5.2f}  (goal > 1: {'met' if x > 1 else 'NOT met'})")
    if draft and draft_eager:
        x = draft["x_eager"]
        lines.append(f"  draft k=4 compile / draft k=4 eager   {x:5.2f}  (goal >= 1.5: {'met' if x >= 1.5 else 'NOT met'})")
    for r in (plain, draft):
        if r and r.get("host_share") is not None:
            lines.append(f"  host share, {r['config']} compile  {r['host_share']:5.2f}  (goal <= 0.15: "
                         f"{'met' if r['host_share'] <= 0.15 else 'NOT met'})")
    return "\n".join(lines)


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _plot(path: Path, rows: list[dict], summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(f"{r['config']} [{r['mode']}]" for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        vals = [next((r["tok_s"] for r in rows if r["batch"] == b and f"{r['config']} [{r['mode']}]" == n), 0)
                for n in names]
        ax.barh(range(len(names)), vals, color=["#888" if n.startswith("hf") else "#3a7" for n in names])
        bound = 1e3 * b / summary["bound_ms_per_token"]
        ax.axvline(bound, color="#c33", linestyle="--", label=f"bound {bound:.0f}")
        ax.set_yticks(range(len(names)), names if b == batches[0] else [""] * len(names), fontsize=8)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("tokens/s (log)")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"{summary['pair']}\n{summary['device']}, {summary['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
