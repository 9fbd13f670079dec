"""The ``specray`` command.

    specray serve [--target DIR] [--once PROMPT]  # OpenAI-compatible HTTP on Ray Serve (vLLM's flags)
    specray generate --prompt "def fib(n):"       # one completion in this process
    specray jobs --input in.jsonl --output out.jsonl   # a batch file (local Ray unless --address)
    specray train draft|pard|medusa|eagle|eagle3|dflash|dspark|redrafter --out DIR
    specray bench speed|load|actors|trees|block|lookahead|penalties|selftune
    specray env                                   # versions, devices, dtype, attention kernel
    specray demo-models                           # build or find the demo pair
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from specray.engine.argparsing import SuggestingParser
from specray.entrypoints import flags as F
from specray.entrypoints.flags import engine_settings
from specray.entrypoints.serving import serve_main

log = logging.getLogger("specray")

BENCHMARKS = {
    "speed": "specray vs Hugging Face generate on the demo pair, batch 1 (tokens/s, acceptance, the bound)",
    "load": "the HTTP server under concurrent streams: plain vs speculative decoding",
    "actors": "per-step cost of the Ray actor layouts against the in-process engine",
    "trees": "tree methods (EAGLE-1/2/3, Medusa, ReDrafter) against plain and draft-model speculation",
    "block": "block drafters: PARD against the draft model, DFlash against EAGLE/EAGLE-2/EAGLE-3, each at its best",
    "lookahead": "lookahead decoding against plain decoding and prompt lookup",
    "suffix": "suffix decoding against plain decoding and prompt lookup, on repetitive and non-repetitive work",
    "online": "online learning on a shifted workload: accepted length over served requests, learning on vs off",
    "gpu": "the step against the memory-bandwidth bound on a GPU (a synthetic 8B-shaped pair; --device cpu: demo)",
    "penalties": "what repetition/presence/frequency penalties cost plain and draft-model decoding",
    "quantization": "FP8 weights on the demo pair: bytes held, decoding speed and acceptance, FP8 vs unquantized",
    "selftune": "the self-tuning speculation length against explicit settings, one-shot and batched",
    "kv": "paged KV: requests held and tokens/s in one KV budget, TTFT with a cached prefix, EAGLE's hit rate",
    "tensor_parallel": "a tensor-parallel target against TP 1: ms/step and the control plane's share (--layout: "
                       "what each rank holds)",
    "grammar": "structured outputs' grammar backends: llguidance vs xgrammar, compile and mask time per token",
    "structured": "structured outputs on a JSON-schema and tool-call workload: constrained vs free plain decoding, "
                  "each method with and without the grammar drafter",
}


def _demo_models(args) -> int:
    from specray.demo import load_or_build_demo_pair

    pair = load_or_build_demo_pair(cache_dir=args.cache_dir, seed=args.seed, force=args.force)
    print(pair.to_json())
    return 0


def request_speculation(args, option_flags: list[F.OptionFlag], default=None, how_default: str = "the default"):
    """The request's speculation from ``--method``, ``--speculation JSON`` and the option flags;
    without a method, ``default`` (options, or None for plain decoding). A flag of another
    method than the request's, or a bad value, is a one-line ValueError naming the flag."""
    from specray.policies.registry import method_spec, parse_speculation, resolve_method

    given = F.given_options(args, option_flags)
    fields = json.loads(args.speculation) if args.speculation else {}
    if not isinstance(fields, dict):
        raise ValueError("--speculation: must be a JSON object of the method's options")
    if args.method is not None:
        fields["method"] = args.method
    how = "--method"
    if "method" not in fields:
        fields = default.model_dump(exclude_unset=True) if default is not None else {"method": "none"}
        how = how_default
    fields.update({flag.field: value for flag, value in given})
    try:  # vLLM's spellings: draft_model, {"method": "draft", "parallel_drafting": true} (PARD)
        method, fields = resolve_method(fields)
    except ValueError as exc:
        raise ValueError(F.one_line(exc, {f.field: f.flag for f in option_flags})) from None
    method_spec(method)  # an unknown method fails here, before any model loads
    F.check_method_flags(method, given, how)
    try:
        return parse_speculation(fields)
    except ValueError as exc:
        raise ValueError(F.one_line(exc, {f.field: f.flag for f in option_flags if method in f.methods})) from None


def _generate(args, option_flags: list[F.OptionFlag]) -> int:
    from specray.engine.llm_engine import LLMEngine
    from specray.engine.params import SamplingParams, best_speculation
    from specray.entrypoints.defaults import resolved
    from specray.policies.registry import method_spec

    file_data = F.load_config_file(args.config)
    cfg = engine_settings(args, file_data)
    engine_cfg = cfg.engine
    # Without --method: the server's default (the config's speculative-config, else the best
    # method the loaded weights allow).
    if engine_cfg.default_speculation is not None:
        default, how = engine_cfg.default_speculation, "the config's speculative-config"
    else:
        default, how = best_speculation(engine_cfg.method_facts()), "the default: the best method these weights allow"
    speculation = request_speculation(args, option_flags, default, how)
    method = speculation.method
    checkpoint = method_spec(method).checkpoint
    demo = engine_cfg.target is None
    if checkpoint and not engine_cfg.engine_config().checkpoint(checkpoint) and not (demo and checkpoint == "draft"):
        raise ValueError(f"--method {method} needs --{checkpoint} DIR")
    constraint = F.structured_output(args)
    try:
        sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, seed=args.seed, stop=args.stop or [],
                                  ignore_eos=bool(args.ignore_eos), structured_outputs=constraint)
    except ValueError as exc:
        raise ValueError(F.one_line(exc, {name: F.flag_name(name) for name in SamplingParams.model_fields})) from None
    F.check_tokenizer(engine_cfg)
    engine_cfg = resolved(engine_cfg.model_copy(update={"max_num_seqs": 1}))
    F.check_structured_output(engine_cfg, args, constraint)
    F.check_weights(engine_cfg, args, file_data)
    if engine_cfg.tensor_parallel_size > 1:  # ranks are actors: a local Ray, as `specray serve` starts
        out = _generate_on_ray(engine_cfg, args.prompt, sampling, speculation)
    else:  # one short run: `auto` on a CPU runs eager (EngineConfig.one_shot)
        out = vars(LLMEngine(engine_cfg.engine_config().one_shot()).generate([args.prompt], sampling, speculation)[0])
    if args.json:
        print(json.dumps({"text": out["text"], "token_ids": out["token_ids"], "finish_reason": out["finish_reason"],
                          "method": speculation.method, "metrics": out["metrics"]}))
    else:
        print(args.prompt + out["text"])
        m = out["metrics"]
        print(f"\n[{len(out['token_ids'])} tokens, finish={out['finish_reason']}, method={speculation.method}, "
              f"mean accepted length {m['mean_accepted_length']:.2f}, target forwards {m['target_forward_passes']}]",
              file=sys.stderr)
    return 0


def _generate_on_ray(config, prompt: str, sampling, speculation) -> dict:
    """One completion through a Coordinator (the actor layout ``serve`` runs): in the Ray this
    process already joined, else in one started here (stopped after)."""
    import ray

    from specray.actors.coordinator import Coordinator, StartError

    local = not ray.is_initialized()
    if local:
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    coordinator = Coordinator.remote(config)
    try:
        return ray.get(coordinator.generate.remote(
            [prompt], sampling.model_dump(), speculation.model_dump(exclude_unset=True)))[0]
    except StartError as exc:  # the layout cannot be hosted, a model cannot load: one line
        cause = getattr(exc, "cause", exc)
        raise ValueError(cause.args[0] if cause.args else str(cause)) from None
    finally:
        try:
            ray.get(coordinator.shutdown.remote(), timeout=60)
        finally:
            ray.kill(coordinator)
            if local:
                ray.shutdown()


def _train(args) -> int:
    from specray.training.recipes import main as train_main

    return train_main([args.what, *args.rest])


def _bench(args) -> int:
    import importlib

    return importlib.import_module(f"specray.bench.{args.what}").main(args.rest)


def _jobs(args) -> int:
    from specray.entrypoints.jobs import main as jobs_main

    return jobs_main(args.rest, prog="specray jobs")


def _env(args) -> int:
    from specray.entrypoints.environment import describe

    print(describe())
    return 0


def _recipes_help() -> str:
    from specray.training.recipes import recipes

    lines = []
    for name, main in sorted(recipes().items()):
        doc = (sys.modules[main.__module__].__doc__ or "").strip().split("\n\n")[0]
        lines.append(f"  {name:10s} {' '.join(doc.split()).split(': ', 1)[-1]}")
    return "recipes:\n" + "\n".join(lines) + "\n\n`specray train RECIPE --help` shows a recipe's options."


def build_parser() -> tuple[argparse.ArgumentParser, list[F.OptionFlag]]:
    parser = SuggestingParser(prog="specray", description="Speculative decoding on Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("serve", help="serve an OpenAI-compatible API (default: the demo pair)",
                       description="Serve an OpenAI-compatible API on Ray Serve. Flags are vLLM's names; "
                                   "--config takes the same names as YAML keys, and flags override it.")
    F.add_model_flags(p)
    F.add_server_flags(p)
    p.set_defaults(func=serve_main)

    p = sub.add_parser("generate", help="generate one completion in this process",
                       description="One completion in this process (no Ray), on the demo pair or --target DIR; "
                                   "with --tensor-parallel-size N > 1, through the actors on a local Ray "
                                   "(or $RAY_ADDRESS's).")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="the serve config file (YAML/JSON); its model settings apply, flags override them")
    p.add_argument("--json", action="store_true", help="print text, token_ids, method and metrics as JSON")
    F.add_model_flags(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, metavar="N", default=64, help="(default: 64)")
    g.add_argument("--temperature", type=float, metavar="T", default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, metavar="P", default=1.0, help="(default: 1.0)")
    g.add_argument("--top-k", type=int, metavar="K", default=0, help="0 = off (default: 0)")
    g.add_argument("--seed", type=int, metavar="N", default=None, help="(default: none)")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                   help="keep generating past EOS (default: off)")
    g = p.add_argument_group("structured output (one of; docs/structured-outputs.md)")
    one = g.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", default=None, help="the output matches this JSON schema")
    one.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    one.add_argument("--regex", metavar="REGEX", default=None, help="the whole output matches this regex")
    one.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    one.add_argument("--grammar", metavar="FILE", default=None, help="a Lark or GBNF grammar the output follows")
    g = p.add_argument_group("speculation")
    import specray.policies  # noqa: F401
    from specray.policies.registry import registered_methods

    g.add_argument("--method", default=None, metavar="METHOD",
                   help=f"one of {', '.join(registered_methods())} (default: the best loaded: draft, then "
                        "heads, then ngram, with a self-tuning length)")
    g.add_argument("--speculation", metavar="JSON", default=None,
                   help="the method's options as JSON, e.g. '{\"method\": \"ngram\"}' (flags below override)")
    taken = set(p._option_string_actions)
    option_flags = F.add_speculation_flags(p, taken)
    p.set_defaults(func=lambda a: _generate(a, option_flags))

    p = sub.add_parser("jobs", help="run a JSONL batch file (starts a local Ray unless --address is given)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="python -m specray.entrypoints.jobs's arguments")
    p.set_defaults(func=_jobs)

    p = sub.add_parser("train", help="train draft heads on a frozen target", formatter_class=raw,
                       description="Train a draft head on a frozen target.", epilog=_recipes_help())
    from specray.training.recipes import recipes

    p.add_argument("what", choices=sorted(recipes()), metavar="RECIPE", help=", ".join(sorted(recipes())))
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the recipe's options")
    p.set_defaults(func=_train)

    p = sub.add_parser("bench", help="benchmarks on the demo pair", formatter_class=raw,
                       description="Benchmarks on the demo pair; each prints a table and writes CSV/JSON/PNG.",
                       epilog="benchmarks:\n" + "\n".join(f"  {k:10s} {v}" for k, v in BENCHMARKS.items())
                       + "\n\n`specray bench NAME --help` shows a benchmark's options.")
    p.add_argument("what", choices=list(BENCHMARKS), metavar="NAME", help=", ".join(BENCHMARKS))
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's options")
    p.set_defaults(func=_bench)

    p = sub.add_parser("env", help="versions, devices, dtype and the attention kernel this machine gets, and why")
    p.set_defaults(func=_env)

    p = sub.add_parser("demo-models", help="build (or find cached) the demo target/draft pair; print JSON paths")
    p.add_argument("--cache-dir", metavar="DIR", default=None, help="default: $SPECRAY_CACHE or ~/.cache/specray")
    p.add_argument("--seed", type=int, metavar="N", default=0, help="(default: 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(func=_demo_models)
    return parser, option_flags


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["jobs"]:  # its own parser (argparse cannot hand a leading --flag to a REMAINDER)
        return _jobs(argparse.Namespace(rest=argv[1:]))
    args = build_parser()[0].parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # a bar per checkpoint loaded says nothing a user needs
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: one line naming the flag, no traceback
        print(f"specray {args.command}: error: {F.one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
