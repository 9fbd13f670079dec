"""Structured outputs on the demo pair: what the mask costs, what speculation buys under it, and
what the grammar drafter adds.

    python -m specray.bench.structured [--batches 1,8] [--prompts-per-row 2] [--rounds 3]
                                       [--max-tokens 96] [--k 4] [--methods draft,ngram,suffix] [--out DIR]

The workload is JSON with a schema, in turns: a record of nested objects, enums, booleans,
bounded integers and arrays, an event report of enums and a nested location, and a tool call
(``tool_choice: "required"`` with two tools, one call: the array-of-calls schema the grammar
layer builds for it, ``protocol/tools.py``), each behind a chat prompt (the demo chat template;
the tool call's renders the tools). Greedy; a request ends where its grammar completes (the stop
token) or at ``--max-tokens``.

Configurations, each its own engine with B slots for B in ``--batches``:

* plain decoding without a constraint (the same prompts, each request as many tokens as its
  constrained output: the same work, the mask aside),
* plain decoding under the constraint, the grammar drafter off and on,
* each of ``--methods`` under the constraint (``--k`` draft tokens a step, ``--k 0``: the
  verification budget chooses), the grammar drafter off and on.

All configurations of a batch size run side by side (``bench/paired.py``: steps interleaved by
progress, CPU seconds of each engine's own steps), ``--rounds`` times; tokens/s are medians over
the rounds, tokens per target forward are generated tokens over target forwards (prefills included), summed
over the rounds. Each round serves new prompts (held-out code in the chat prompts). Every
constrained configuration's tokens are checked against plain constrained decoding's (lossless).

Goals (issue 56): constrained plain (drafter off) >= 0.9x unconstrained plain's tokens/s at
batch 8; the best constrained speculation >= 1.5x constrained plain at batch 1; the grammar
drafter lifts tokens per target forward by >= 20% over the same method without it. Prints the
table, writes structured.{txt,csv,json,png} to --out; exit code 1 where a goal is missed.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import statistics
import sys

from specray.bench import DEFAULT_OUT, announce

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["module", "class", "function", "constant"]},
        "public": {"type": "boolean"},
        "lines": {"type": "integer", "minimum": 0, "maximum": 9999},
        "imports": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"author": {"type": "string", "maxLength": 16},
                                                  "license": {"enum": ["MIT", "PSF", "BSD"]},
                                                  "tested": {"type": "boolean"}},
                 "required": ["author", "license", "tested"], "additionalProperties": False},
    },
    "required": ["name", "kind", "public", "lines", "imports", "meta"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "event": {"enum": ["opened", "closed", "raised", "returned"]},
        "where": {"type": "object", "properties": {"file": {"type": "string", "maxLength": 20},
                                                   "line": {"type": "integer", "minimum": 1, "maximum": 9999}},
                  "required": ["file", "line"], "additionalProperties": False},
        "severity": {"enum": ["low", "medium", "high"]},
        "tags": {"type": "array", "items": {"enum": ["io", "parse", "network", "memory"]}, "maxItems": 3},
    },
    "required": ["event", "where", "severity", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the standard library's source",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20},
                                                        "language": {"enum": ["python", "c"]},
                                                        "max_results": {"type": "integer", "minimum": 1,
                                                                        "maximum": 50}},
                       "required": ["query", "language", "max_results"], "additionalProperties": False}}},
]
GOAL_MASK, GOAL_SPEC, GOAL_LIFT = 0.9, 1.5, 1.2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specray.bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8", help="batch sizes (slots), comma-separated")
    p.add_argument("--prompts-per-row", type=int, default=2, metavar="X", help="X times the batch size of requests")
    p.add_argument("--rounds", type=int, default=3, help="side-by-side runs (medians of tokens/s)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="draft tokens a step for each method (0: the budget chooses)")
    p.add_argument("--methods", default="draft,ngram,suffix", help="methods under the constraint, comma-separated")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    args = p.parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    command = announce("structured", argv)
    try:
        return _run(args, command)
    finally:
        torch.set_num_threads(threads)  # announce pinned one thread for the run


def _run(args, command: str) -> int:
    rows = []
    for batch in (int(b) for b in args.batches.split(",") if b):
        rows += _batch(args, batch)
    goals, lines = _goals(rows)
    text = "\n".join(_table(rows) + [""] + lines)
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.txt").write_text(f"command: {command}\n{text}\n")
    (out / "structured.json").write_text(json.dumps({"command": command, "rows": rows, "goals": goals}, indent=1))
    with open(out / "structured.csv", "w", newline="") as f:
        fields = [k for k in rows[0] if k != "rounds"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "structured.png")
    print(f"wrote {out / 'structured.txt'}, .csv, .json and .png")
    return 0 if all(goals.values()) else 1


def workload(n: int, tokenizer) -> tuple[list[list[int]], list[dict]]:
    """``n`` chat prompts (token ids) and their constraints, the three kinds in turn."""
    from specray.demo.prompts import corpus_prompts
    from specray.protocol.tools import call_schema

    # held-out code, lengths not required to differ (asked of more prompts than lengths, that fails)
    code = corpus_prompts(n, tokenizer.name_or_path, "held_out", 24, 64, distinct_lengths=False)
    calls = call_schema([(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS], None, parallel=False)
    prompts, constraints = [], []
    for i, snippet in enumerate(code):
        kind = i % 3
        if kind == 0:
            ask, schema, tools = "Describe this code as a JSON record:\n" + snippet, RECORD, None
        elif kind == 1:
            ask, schema, tools = "Report what this code does as a JSON event:\n" + snippet, EVENT, None
        else:
            ask, schema, tools = "Find where this is defined:\n" + snippet, calls, TOOLS
        ids = tokenizer.apply_chat_template([{"role": "user", "content": ask}], tools=tools,
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        constraints.append({"json": schema})
    return prompts, constraints


def configs(methods: list[str]) -> list[tuple[str, str, bool, bool]]:
    """(name, method, constrained, grammar drafter) of every side."""
    out = [("plain, free", "none", False, False), ("plain", "none", True, False), ("plain + grammar", "none", True, True)]
    for m in methods:
        out += [(m, m, True, False), (f"{m} + grammar", m, True, True)]
    return out


def _batch(args, batch: int) -> list[dict]:
    """Every configuration at ``batch`` slots, side by side, ``--rounds`` times; each round serves
    new prompts (suffix decoding's global tree keeps what earlier rounds generated: the same
    prompts again would be answered from memory)."""
    from transformers import AutoTokenizer

    from specray.demo import load_or_build_demo_pair
    from specray.engine import EngineConfig, LLMEngine, SamplingParams, SpeculationParams

    pair = load_or_build_demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(pair.tokenizer)
    sides = configs([m for m in args.methods.split(",") if m])
    engines = [LLMEngine(EngineConfig(target=pair.target, draft=pair.draft, tokenizer=pair.tokenizer, max_num_seqs=batch,
                                      max_model_len=1024, grammar_drafter=drafter, profile_costs=False))
               for _, _, _, drafter in sides]
    length = {"num_speculative_tokens": args.k} if args.k else {}
    n = batch * args.prompts_per_row
    prompts, constraints = workload(n * args.rounds, tokenizer)
    totals = [{"tokens": 0, "forwards": 0, "forced": 0, "forced_accepted": 0, "rates": []} for _ in sides]
    for r in range(args.rounds):
        these = slice(r * n, (r + 1) * n)
        constrained_sampling = [SamplingParams(max_tokens=args.max_tokens, temperature=0, structured_outputs=c)
                                for c in constraints[these]]
        # The free side generates as many tokens per request as the constrained output has (a
        # run of requests that end apart keeps fewer rows busy than one of equal lengths).
        lengths = [len(o.token_ids) for o in engines[1].generate(prompts[these], constrained_sampling)]
        runs = []
        for _, method, constrained, _ in sides:
            sampling = constrained_sampling if constrained else [
                SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]
            spec = SpeculationParams(method=method, **(length if method != "none" else {}))
            runs.append((sampling, [spec] * n))
        order = list(range(len(sides)))
        order = order[r % len(order):] + order[: r % len(order)]  # who steps first turns each round
        results = _round(engines, runs, order, prompts[these])
        for i, (name, _, constrained, _) in enumerate(sides):
            res = results[i]
            if constrained and res["ids"] != results[1]["ids"]:  # side 1: plain constrained decoding
                raise AssertionError(f"batch {batch}, {name}: output differs from plain constrained decoding")
            for key in ("tokens", "forwards", "forced", "forced_accepted"):
                totals[i][key] += res[key]
            totals[i]["rates"].append(res["tokens"] / res["seconds"])
    rows = []
    for (name, method, constrained, drafter), t in zip(sides, totals):
        rows.append({"batch": batch, "config": name, "method": method, "constrained": constrained,
                     "grammar_drafter": drafter, "tokens": t["tokens"], "forwards": t["forwards"],
                     "tokens_per_forward": round(t["tokens"] / t["forwards"], 3),
                     "tokens_per_s": round(statistics.median(t["rates"]), 1),
                     "rounds": [round(x, 1) for x in t["rates"]],
                     "forced_tokens": t["forced"], "forced_accepted": t["forced_accepted"]})
    return rows


def _round(engines, runs, order, prompts) -> dict[int, dict]:
    """One side-by-side run of every configuration (``order``: the sides' order this round), each
    with a fresh length policy of its engine's."""
    from specray.bench.paired import side_by_side

    sides = [(engines[i], runs[i][1], engines[i].driver.length_policy.fresh(), runs[i][0]) for i in order]
    return dict(zip(order, side_by_side(sides, prompts, [])))


def _goals(rows: list[dict]) -> tuple[dict, list[str]]:
    """Each goal of the issue, met or not, and a line per reading."""
    by = {(r["batch"], r["config"]): r for r in rows}
    batches = sorted({r["batch"] for r in rows})
    goals, lines = {}, []
    if 8 in batches:
        x = by[8, "plain"]["tokens_per_s"] / by[8, "plain, free"]["tokens_per_s"]
        goals["mask"] = x >= GOAL_MASK
        lines.append(f"constrained plain / free plain tokens/s at batch 8: {x:.3f}x (goal >= {GOAL_MASK})")
    if 1 in batches:
        spec = [r for r in rows if r["batch"] == 1 and r["constrained"] and r["method"] != "none"]
        best = max(spec, key=lambda r: r["tokens_per_s"])
        x = best["tokens_per_s"] / by[1, "plain"]["tokens_per_s"]
        goals["speculation"] = x >= GOAL_SPEC
        lines.append(f"best constrained speculation at batch 1 ({best['config']}) / constrained plain tokens/s: "
                     f"{x:.2f}x (goal >= {GOAL_SPEC})")
    lifts = []
    for r in rows:
        if r["grammar_drafter"]:
            base = by[r["batch"], r["config"].removesuffix(" + grammar")]
            lift = r["tokens_per_forward"] / base["tokens_per_forward"]
            lifts.append(lift)
            lines.append(f"batch {r['batch']}, {base['config']}: grammar drafter lifts tokens per target forward "
                         f"{lift:.2f}x ({base['tokens_per_forward']} -> {r['tokens_per_forward']}), "
                         f"tokens/s {r['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    goals["lift"] = bool(lifts) and min(lifts) >= GOAL_LIFT
    lines.append(f"grammar drafter: least lift in tokens per target forward {min(lifts):.2f}x (goal >= {GOAL_LIFT})")
    lines += [f"goal {name}: {'met' if ok else 'MISSED'}" for name, ok in goals.items()]
    return goals, lines


def _table(rows: list[dict]) -> list[str]:
    head = f"{'batch':>5}  {'config':<20} {'tokens':>6} {'forwards':>8} {'tok/fwd':>7} {'tok/s':>7}  " \
           f"{'forced (accepted)':>17}  rounds tok/s"
    out = [head, "-" * len(head)]
    for r in rows:
        forced = f"{r['forced_tokens']} ({r['forced_accepted']})" if r["grammar_drafter"] else "-"
        out.append(f"{r['batch']:>5}  {r['config']:<20} {r['tokens']:>6} {r['forwards']:>8} {r['tokens_per_forward']:>7}"
                   f" {r['tokens_per_s']:>7}  {forced:>17}  {r['rounds']}")
    return out


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Tokens per target forward and tokens/s per configuration, one panel pair per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 6), squeeze=False)
    for j, b in enumerate(batches):
        mine = [r for r in rows if r["batch"] == b]
        colors = ["tab:gray" if not r["constrained"] else "tab:green" if r["grammar_drafter"] else "tab:blue"
                  for r in mine]
        for i, (key, label) in enumerate((("tokens_per_forward", "tokens per target forward"),
                                          ("tokens_per_s", "tokens/s (CPU s)"))):
            ax = axes[i][j]
            ax.bar(range(len(mine)), [r[key] for r in mine], color=colors)
            ax.set_xticks(range(len(mine)), [r["config"].replace(" + ", "\n+ ") for r in mine], fontsize=7)
            ax.set_ylabel(label, fontsize=8)
            ax.set_title(f"batch {b}", fontsize=9)
    fig.suptitle("JSON schemas and a tool call on the demo pair: gray free, blue constrained, green + grammar drafter",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
