"""Tests for specray.demo: the corpus split (fast), growing a target (fast, random
weights) and the trained, cached demo pair (slow: built once into $SPECRAY_CACHE or
~/.cache/specray, a few CPU minutes the first time)."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from specray.demo import DemoPair, corpus_documents, held_out_prompts, load_or_build_demo_pair
from specray.demo.corpus import is_excluded, list_corpus_paths, split_of
from specray.demo import pair as pair_mod
from specray.demo.pair import METRICS_FILE, PAIR_PARTS, pair_key
from specray.demo.training import DemoRecipe, grow_target, model_config

ALPHA_MIN = 0.6
COST_RATIO_MAX = 0.25


# ---------------------------------------------------------------- fast: no trained weights


def test_corpus_split_is_deterministic_and_disjoint():
    paths = list_corpus_paths()
    assert paths == sorted(paths) and len(paths) > 100
    assert [split_of(p) for p in paths] == [split_of(p) for p in list(paths)]
    train = {d.relpath for d in corpus_documents("train")}
    held = {d.relpath for d in corpus_documents("held_out")}
    assert train and held and not train & held
    assert 0.02 < len(held) / (len(held) + len(train)) < 0.10
    assert all(split_of(p) == "held_out" for p in held)
    assert not any(is_excluded(p) for p in train | held)


def test_corpus_excludes_tests_and_third_party():
    for path in ("test/test_os.py", "idlelib/idle_test/test_x.py", "lib2to3/tests/data/a.py",
                 "site-packages/pkg/mod.py", "unittest/test/testmock/x.py"):
        assert is_excluded(path), path
    assert not is_excluded("json/decoder.py")
    assert not any(p.startswith(("test/", "site-packages/")) for p in list_corpus_paths())


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match="split"):
        corpus_documents("validation")


def test_grown_target_equals_draft_before_training():
    recipe = DemoRecipe(vocab_size=64, hidden_size=16, intermediate_size=32,
                        draft_layers=1, target_layers=3)
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    draft = LlamaForCausalLM(model_config(recipe, 1, eos_id=0, pad_id=1)).eval()
    target = grow_target(draft, recipe, seed=0).eval()
    assert target.config.num_hidden_layers == 3
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, draft(ids).logits, rtol=0, atol=1e-6)


def test_demo_pair_json_has_the_five_fields():
    pair = DemoPair(target="t", draft="d", tokenizer="k", alpha=0.7, cost_ratio=0.2)
    assert json.loads(pair.to_json()) == {
        "target": "t", "draft": "d", "tokenizer": "k", "alpha": 0.7, "cost_ratio": 0.2}


def _fake_build(out_dir, seed, recipe, measure):
    """Stands in for training: logs the call, takes a moment, writes a complete pair."""
    with open(os.environ["FAKE_BUILD_LOG"], "a") as fh:
        fh.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    if os.environ.get("FAKE_BUILD_FAIL"):
        raise KeyboardInterrupt  # as if the user hit Ctrl-C mid-build
    for part, names in PAIR_PARTS.items():
        (out_dir / part).mkdir()
        for name in names:
            (out_dir / part / name).write_text("{}")
    metrics = {"alpha": 0.7, "cost_ratio": 0.2, "draft_step_ms": 1.0, "target_step_ms": 5.0,
               "held_out_loss": {"draft": 4.0, "target": 3.9}}
    (out_dir / METRICS_FILE).write_text(json.dumps(metrics))
    return metrics


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    log = tmp_path / "builds.log"
    log.touch()
    monkeypatch.setenv("FAKE_BUILD_LOG", str(log))
    monkeypatch.setattr(pair_mod, "build_demo_pair", _fake_build)
    monkeypatch.setattr(pair_mod, "SHIPPED_DIR", tmp_path / "shipped")  # none: every seed is built
    cache = tmp_path / "cache"
    return cache, lambda: len(log.read_text().split())


def _leftovers(cache: pathlib.Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("."))


def test_build_then_load_from_cache(fake_build):
    cache, builds = fake_build
    pair = load_or_build_demo_pair(str(cache), seed=3)
    assert pathlib.Path(pair.target).parent.name == pair_key(3, DemoRecipe())
    assert (pair.alpha, pair.cost_ratio) == (0.7, 0.2)
    assert load_or_build_demo_pair(str(cache), seed=3) == pair
    assert builds() == 1 and _leftovers(cache) == []
    load_or_build_demo_pair(str(cache), seed=3, force=True)
    assert builds() == 2 and _leftovers(cache) == []


def test_cache_dir_from_environment(fake_build, monkeypatch):
    cache, _ = fake_build
    monkeypatch.setenv("SPECRAY_CACHE", str(cache))
    assert load_or_build_demo_pair().target.startswith(str(cache))


def test_interrupted_build_leaves_no_pair(fake_build, monkeypatch):
    cache, builds = fake_build
    monkeypatch.setenv("FAKE_BUILD_FAIL", "1")
    with pytest.raises(KeyboardInterrupt):
        load_or_build_demo_pair(str(cache))
    assert not (cache / pair_key(0, DemoRecipe())).exists() and _leftovers(cache) == []
    monkeypatch.delenv("FAKE_BUILD_FAIL")
    load_or_build_demo_pair(str(cache))
    assert builds() == 2


def test_incomplete_pair_is_rebuilt(fake_build):
    cache, builds = fake_build
    (cache / pair_key(0, DemoRecipe()) / "target").mkdir(parents=True)
    pair = load_or_build_demo_pair(str(cache))
    assert builds() == 1 and pathlib.Path(pair.draft, "model.safetensors").is_file()


def test_a_shipped_pair_is_unpacked_when_its_stamp_matches_the_recipe(fake_build, tmp_path):
    cache, builds = fake_build
    shipped = pair_mod.SHIPPED_DIR
    shipped.mkdir()
    metrics = _fake_build(shipped, 0, None, None)
    assert builds() == 1
    stamp = {**metrics, "seed": 0, "recipe": dataclasses.asdict(DemoRecipe()),
             "versions": {"demo": pair_mod.DEMO_VERSION}}
    (shipped / METRICS_FILE).write_text(json.dumps(stamp))
    pair = load_or_build_demo_pair(str(cache))
    assert builds() == 1 and pathlib.Path(pair.target).parent == cache / pair_key(0, DemoRecipe())
    assert load_or_build_demo_pair(str(cache), seed=1) and builds() == 2  # another seed is built
    load_or_build_demo_pair(str(cache), force=True)  # --force trains here, whatever is shipped
    assert builds() == 3
    (shipped / METRICS_FILE).write_text(json.dumps({**stamp, "recipe": {**stamp["recipe"], "draft_steps": 1}}))
    assert pair_mod.shipped_pair(0, DemoRecipe()) is None  # a stale stamp is never served


def test_the_shipped_pair_is_this_recipes(tmp_path):
    """The weights in the package were built by today's recipe and seed 0 (a recipe change without
    `python -m specray.demo --force --ship` fails here, not at a user's first run)."""
    assert pair_mod.shipped_pair(0, DemoRecipe()) == pair_mod.SHIPPED_DIR
    for part, names in PAIR_PARTS.items():
        for name in names:
            assert (pair_mod.SHIPPED_DIR / part / name).is_file(), (part, name)
    target = json.loads((pair_mod.SHIPPED_DIR / "target" / "config.json").read_text())
    assert (target["num_hidden_layers"], target["hidden_size"]) == (DemoRecipe().target_layers,
                                                                    DemoRecipe().hidden_size)


def _call_in_child(cache: str, results) -> None:
    results.put(load_or_build_demo_pair(cache).to_json())


@pytest.mark.slow  # starts processes
def test_concurrent_callers_build_once(fake_build):
    cache, builds = fake_build
    ctx = multiprocessing.get_context("fork")  # children inherit the fake builder
    results = ctx.Queue()
    procs = [ctx.Process(target=_call_in_child, args=(str(cache), results)) for _ in range(3)]
    for proc in procs:
        proc.start()
    outputs = [results.get(timeout=30) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert builds() == 1 and len(set(outputs)) == 1


# ---------------------------------------------------------------- slow: the trained pair


@pytest.fixture(scope="session")
def demo_pair() -> DemoPair:
    return load_or_build_demo_pair()


_OFFLINE_CHECK = """
import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
pair = json.loads(sys.argv[1])
tok = AutoTokenizer.from_pretrained(pair["tokenizer"])
target = AutoModelForCausalLM.from_pretrained(pair["target"])
draft = AutoModelForCausalLM.from_pretrained(pair["draft"])
print(json.dumps({
    "vocab": [target.config.vocab_size, draft.config.vocab_size, len(tok)],
    "layers": [target.config.num_hidden_layers, draft.config.num_hidden_layers],
    "max_pos": target.config.max_position_embeddings,
    "dtype": str(next(target.parameters()).dtype),
    "padding_side": tok.padding_side,
    "eos": [tok.eos_token, tok.eos_token_id, target.config.eos_token_id],
    "pad": tok.pad_token_id,
}))
"""


@pytest.mark.slow
def test_pair_loads_offline(demo_pair):
    # A fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE at import time.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _OFFLINE_CHECK, demo_pair.to_json()],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(set(info["vocab"])) == 1
    assert info["layers"][0] > info["layers"][1]
    assert info["max_pos"] >= 2048 and info["dtype"] == "torch.float32"
    assert info["padding_side"] == "left"
    assert info["eos"][0] == "<|endoftext|>" and info["eos"][1] == info["eos"][2]
    assert info["pad"] is not None and info["pad"] != info["eos"][1]


@pytest.mark.slow
def test_recorded_quality_meets_targets(demo_pair):
    metrics = json.loads((pathlib.Path(demo_pair.target).parent / METRICS_FILE).read_text())
    assert metrics["alpha"] == demo_pair.alpha >= ALPHA_MIN
    assert metrics["cost_ratio"] == demo_pair.cost_ratio <= COST_RATIO_MAX


@pytest.mark.slow
def test_second_call_loads_the_same_pair(demo_pair):
    assert load_or_build_demo_pair() == demo_pair


@pytest.mark.slow
def test_held_out_prompts(demo_pair):
    n = 60
    prompts = held_out_prompts(n, demo_pair.tokenizer)
    assert prompts == held_out_prompts(n, demo_pair.tokenizer)  # deterministic
    assert len(prompts) == n and len(set(prompts)) == n
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_pair.tokenizer)
    lengths = [len(tok(p)["input_ids"]) for p in prompts]
    assert len(set(lengths)) == n
    assert all(32 <= length <= 256 for length in lengths)
    train = [d.text for d in corpus_documents("train")]
    for prompt in prompts:
        assert not any(prompt in text for text in train)


@pytest.mark.slow
def test_tokenizer_round_trips_and_renders_chat(demo_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_pair.tokenizer)
    text = "def f(x) :\n\tréturn x . y ,  [1 ,2]  # ünïcode ✓\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
