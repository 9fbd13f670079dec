"""Grammar backends for structured outputs: llguidance against xgrammar, on this machine.

    python -m specray.bench.grammar [--vocab 32000] [--repeats 3] [--out bench/results]

For each tokenizer — the demo pair's (2,048 tokens) and a byte-level BPE of ``--vocab`` tokens
trained here on the Python standard library's source (the demo vocabulary says little about
real ones; cached in the specray cache) — and each backend: the time to read the tokenizer,
to compile each grammar (a JSON schema, a regex, a choice of 20 strings, a Lark/GBNF grammar),
and to fill one token mask, averaged over a valid output driven through the matcher token by
token (what a step pays per scored position). Prints the table; writes grammar.{csv,png}.
xgrammar is measured only where it is installed (it is not a dependency: ``pip install
xgrammar``).
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "kind": {"enum": ["function", "class", "module"]},
        "lines": {"type": "integer", "minimum": 0, "maximum": 9999},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "pure": {"type": "boolean"},
    },
    "required": ["name", "kind", "lines", "args", "pure"],
    "additionalProperties": False,
}
SCHEMA_OUTPUT = '{"name": "parse_args", "kind": "function", "lines": 42, "args": ["argv", "env"], "pure": false}'
REGEX = r"(\d{1,3}\.){3}\d{1,3}( [a-z]+)*"
REGEX_OUTPUT = "192.168.0.1 is the gateway here"
CHOICES = [f"option number {i} of twenty" for i in range(20)]
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\nfactor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/'
GBNF = ('root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
        'factor ::= [0-9]+ | "(" expr ")"')
EXPR_OUTPUT = "(12+3)*45-6/(7+8)"
GRAMMARS = [("json schema", "json", SCHEMA, SCHEMA_OUTPUT), ("regex", "regex", REGEX, REGEX_OUTPUT),
            ("choice of 20", "choice", CHOICES, CHOICES[13]), ("grammar", "grammar", None, EXPR_OUTPUT)]


def trained_bpe(vocab: int):
    """A byte-level BPE of ``vocab`` tokens on the standard library's source (cached)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specray.demo.pair import default_cache_dir

    path = default_cache_dir() / f"bench-bpe-{vocab}"
    if not (path / "tokenizer.json").exists():
        files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train([str(f) for f in files], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        from specray.engine.grammar import Grammars

        self.grammars = Grammars(tokenizer, len(tokenizer), tokenizer.eos_token_id)
        self.grammars.ll_tokenizer  # noqa: B018 - read the tokenizer now (timed)

    def compile(self, kind, value):
        import llguidance

        source = self.grammars.source(kind, GBNF if kind == "grammar" else value)
        return lambda: llguidance.LLMatcher(self.grammars.ll_tokenizer, source)

    def drive(self, matcher, tokens) -> list[float]:
        import llguidance.torch as lt

        bits = lt.allocate_token_bitmask(1, self.grammars.width)
        times = []
        for t in tokens:
            start = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, bits, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(t), matcher.get_error()
        return times


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.x = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.vocab = len(tokenizer)

    def compile(self, kind, value):
        c = self.compiler
        if kind == "json":
            g = c.compile_json_schema(json.dumps(value), any_whitespace=False, separators=(", ", ": "))
        elif kind == "regex":
            g = c.compile_regex(value)
        elif kind == "choice":
            g = c.compile_grammar("root ::= " + " | ".join(json.dumps(v) for v in value))
        else:
            g = c.compile_grammar(GBNF)
        return lambda: self.x.GrammarMatcher(g)

    def drive(self, matcher, tokens) -> list[float]:
        bits = self.x.allocate_token_bitmask(1, self.vocab)
        times = []
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bits)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(t)
        return times


def backends():
    out = [LLGuidance]
    try:
        import xgrammar  # noqa: F401

        out.append(XGrammar)
    except ImportError:
        pass
    return out


def measure(tokenizer, label: str, repeats: int) -> list[dict]:
    rows = []
    for backend in backends():
        start = time.perf_counter()
        b = backend(tokenizer)
        tokenizer_s = time.perf_counter() - start
        for name, kind, value, output in GRAMMARS:
            tokens = tokenizer.encode(output, add_special_tokens=False)
            compiles, masks = [], []
            for _ in range(repeats):
                if backend is LLGuidance:
                    b.grammars._sources.clear()
                start = time.perf_counter()
                make = b.compile(kind, value)
                matcher = make()
                compiles.append(time.perf_counter() - start)
                masks += b.drive(matcher, tokens)
            rows.append({"tokenizer": label, "backend": b.name, "grammar": name, "tokenizer_s": round(tokenizer_s, 3),
                         "compile_ms": round(min(compiles) * 1e3, 2),
                         "mask_us_per_token": round(statistics.median(masks) * 1e6, 1),
                         "mask_us_p90": round(sorted(masks)[int(0.9 * (len(masks) - 1))] * 1e6, 1),
                         "tokens": len(tokens)})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="specray bench grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000, help="the trained BPE's vocabulary (default: 32000)")
    p.add_argument("--repeats", type=int, default=3, help="compiles per grammar and backend (default: 3)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    import torch

    from specray.demo import load_or_build_demo_pair
    from specray.engine.config import load_tokenizer

    torch.set_num_threads(1)
    demo = load_tokenizer(load_or_build_demo_pair().tokenizer)
    rows = measure(demo, f"demo ({len(demo)})", args.repeats)
    big = trained_bpe(args.vocab)
    rows += measure(big, f"BPE ({len(big)})", args.repeats)
    cols = ["tokenizer", "backend", "grammar", "tokenizer_s", "compile_ms", "mask_us_per_token", "mask_us_p90"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "grammar.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['tokenizer']}\n{r['grammar']}" for r in rows if r["backend"] == "llguidance"]
    for i, name in enumerate(sorted({r["backend"] for r in rows})):
        vals = [r["mask_us_per_token"] for r in rows if r["backend"] == name]
        ax.bar([j + 0.4 * i for j in range(len(vals))], vals, width=0.4, label=name)
    ax.set_xticks([j + 0.2 for j in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("µs per token mask (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "grammar.png", dpi=120)
    print(f"wrote {out / 'grammar.csv'} and {out / 'grammar.png'}")


if __name__ == "__main__":
    main()
