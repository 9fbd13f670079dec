"""The ``specray`` command.

    specray demo-models                       # build or find the demo pair, print JSON
    specray generate --prompt "def fib(n):" --method draft --num-speculative-tokens 4
    specray serve [--config FILE]             # OpenAI-compatible HTTP on Ray Serve
    specray bench                             # speed table + plot on the demo pair
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

log = logging.getLogger("specray")


def _demo_models(args) -> int:
    from specray.demo import load_or_build_demo_pair

    pair = load_or_build_demo_pair(cache_dir=args.cache_dir, seed=args.seed, force=args.force)
    print(pair.to_json())
    return 0


def _speculation(args):
    """The request's speculation from ``--method``, ``--speculation JSON`` and the per-field flags."""
    from specray.policies.registry import method_spec, parse_speculation

    fields = json.loads(args.speculation) if args.speculation else {}
    method = fields.setdefault("method", args.method)
    options = method_spec(method).options  # an unknown method fails here, before any model loads
    for name in options.model_fields:
        value = getattr(args, f"spec_{name}", None)
        if name != "method" and value is not None:
            fields[name] = value
    return parse_speculation(fields)


def _add_speculation_flags(p: argparse.ArgumentParser) -> None:
    """One flag per field of every method's options (``--num-speculative-tokens``, ``--tree``,
    ...); a name taken by a sampling flag gets its method's prefix (``--eagle-top-k``).
    List-valued fields take JSON."""
    import typing

    import specray.policies  # noqa: F401  (registers the methods)
    from specray.policies.registry import method_spec, registered_methods

    taken = set(p._option_string_actions)
    seen: set[str] = set()
    for method in registered_methods():
        for name, info in method_spec(method).options.model_fields.items():
            if name == "method" or name in seen:
                continue
            seen.add(name)
            flag = "--" + name.replace("_", "-")
            if flag in taken:
                flag = f"--{method}-" + name.replace("_", "-")
            kinds = [a for a in typing.get_args(info.annotation) or (info.annotation,) if a is not type(None)]
            kind = kinds[0] if kinds else str
            if getattr(kind, "__origin__", None) in (list, tuple) or kind in (list, dict):
                conv = json.loads
            elif kind is bool:
                conv = lambda v: v.lower() in ("1", "true", "yes")  # noqa: E731
            elif kind in (int, float, str):
                conv = kind
            else:
                conv = str
            p.add_argument(flag, dest=f"spec_{name}", type=conv, default=None,
                           help=f"{method}: {info.description or name}")


def _generate(args) -> int:
    from specray.engine.config import EngineConfig
    from specray.engine.engine import LLMEngine
    from specray.engine.params import SamplingParams

    if args.draft and not args.target:
        raise SystemExit("--draft needs --target (without both, the demo pair is used)")
    speculation = _speculation(args)  # fail before loading any model
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
    )
    checkpoints = {k: v for k, v in _checkpoint_flags(args).items() if k not in ("draft", "medusa")}
    if speculation.method != "none" and (spec_checkpoint := _method_checkpoint(speculation.method)):
        if not (getattr(args, spec_checkpoint, None) or (spec_checkpoint == "draft" and not args.target)):
            raise SystemExit(f"--method {speculation.method} needs --{spec_checkpoint} DIR")
    target, draft, tokenizer = args.target, args.draft, None
    if target is None:
        from specray.demo import load_or_build_demo_pair

        pair = load_or_build_demo_pair()
        target, draft, tokenizer = pair.target, draft or pair.draft, pair.tokenizer
    engine = LLMEngine(EngineConfig(target=target, draft=draft, tokenizer=tokenizer, medusa=args.medusa,
                                    checkpoints=checkpoints, max_num_seqs=1, device=args.device))
    out = engine.generate([args.prompt], sampling, speculation)[0]
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "metrics": out.metrics}))
    else:
        print(args.prompt + out.text)
        m = out.metrics
        print(
            f"\n[{len(out.token_ids)} tokens, finish={out.finish_reason}, method={speculation.method}, "
            f"mean accepted length {m['mean_accepted_length']:.2f}, "
            f"target forwards {m['target_forward_passes']}]",
            file=sys.stderr,
        )
    return 0


def _method_checkpoint(method: str) -> str | None:
    from specray.policies.registry import method_spec

    return method_spec(method).checkpoint


def _checkpoint_flags(args) -> dict[str, str]:
    """--draft/--medusa/--<method> DIR flags given: checkpoint key -> directory."""
    return {key: getattr(args, key) for key in _checkpoint_keys() if getattr(args, key, None)}


def _checkpoint_keys() -> list[str]:
    import specray.policies  # noqa: F401
    from specray.policies.registry import method_spec, registered_methods

    keys = [method_spec(m).checkpoint for m in registered_methods()]
    return sorted({k for k in keys if k})


def _add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """--<key> DIR for every method with weights (draft and target flags are added apart)."""
    for key in _checkpoint_keys():
        if key != "draft":
            p.add_argument(f"--{key}", default=None, help=f"{key} weights dir (enables method '{key}')")


def _serve(args) -> int:
    import time

    import ray
    from ray import serve

    from specray.serve.app import build_app
    from specray.serve.config import ServeConfig

    data = _load_config(args.config) if args.config else {}
    engine = dict(data.get("engine", {}))
    if args.target:
        engine.update({"target": args.target, "draft": args.draft, "tokenizer": args.tokenizer})
    for key, path in _checkpoint_flags(args).items():
        if key == "medusa":
            engine["medusa"] = path
        elif key != "draft":
            engine.setdefault("checkpoints", {})[key] = path
    data["engine"] = engine
    for key in ("host", "port", "model_name"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    cfg = ServeConfig.model_validate(data)
    ray.init(address=args.address, include_dashboard=False)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name="specray", route_prefix=cfg.route_prefix, blocking=False)
    url = f"http://{cfg.host}:{cfg.port}"
    print(f"specray serving {cfg.model_name!r} at {url}/v1")
    print(
        f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{cfg.model_name}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 32, "
        f"\"temperature\": 0, \"speculation\": {{\"method\": \"draft\"}}}}'",
        flush=True,
    )
    print(f"  watch speculation live: {url}{(cfg.route_prefix or '').rstrip('/')}/playground", flush=True)
    if args.once:  # answer one request through HTTP, then stop (the README's main job)
        import httpx

        body = {"model": cfg.model_name, "prompt": args.once, "max_tokens": 48, "temperature": 0,
                "speculation": {"method": "draft", "num_speculative_tokens": 4}}
        headers = {"Authorization": f"Bearer {cfg.resolved_api_key()}"} if cfg.resolved_api_key() else {}
        reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300).json()
        print(json.dumps(reply, indent=2))
        serve.shutdown()
        return 0 if "choices" in reply else 1
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


def _load_config(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def _train(args) -> int:
    from specray.cluster.training import main as train_main, recipes

    if args.what not in recipes():
        raise ValueError(f"unknown training target {args.what!r}; known: {sorted(recipes())}")
    return train_main([args.what, *args.rest])


def _bench(args) -> int:
    from specray.bench.speed import main as bench_main

    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specray", description="Speculative decoding on Ray.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo-models", help="build (or find cached) the demo target/draft pair; print JSON paths")
    p.add_argument("--cache-dir", default=None, help="default: $SPECRAY_CACHE or ~/.cache/specray")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(func=_demo_models)

    p = sub.add_parser("generate", help="generate one completion")
    p.add_argument("--prompt", required=True)
    p.add_argument("--method", default="draft", help="a registered method: none, draft, ngram, medusa, ... (default: draft)")
    p.add_argument("--speculation", default=None, help="the method's options as JSON (flags below override)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--target", default=None, help="target checkpoint dir (default: demo pair)")
    p.add_argument("--draft", default=None, help="draft checkpoint dir")
    _add_checkpoint_flags(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print text, token_ids and metrics as JSON")
    _add_speculation_flags(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser("serve", help="serve an OpenAI-compatible API (default: the demo pair)")
    p.add_argument("--config", default=None, help="YAML/JSON ServeConfig file (see examples/)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--tokenizer", default=None)
    _add_checkpoint_flags(p)
    p.add_argument("--model-name", dest="model_name", default=None)
    p.add_argument("--host", default=None, help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--address", default=None, help="Ray address (default: start a local Ray)")
    p.add_argument("--once", metavar="PROMPT", default=None, help="answer one completion for PROMPT, then exit")
    p.set_defaults(func=_serve)

    p = sub.add_parser("train", help="train draft heads: `specray train medusa|eagle|eagle3|redrafter --out DIR [--target DIR]`")
    p.add_argument("what", help="medusa | eagle | eagle3 | redrafter")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_train)

    p = sub.add_parser("bench", help="speed benchmark on the demo pair (see specray.bench.speed --help)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # bad parameters: a clear message, not a traceback
        print(f"specray: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
