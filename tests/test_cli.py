"""The specray command: generate on the demo pair and on one's own checkpoint, vLLM's flags
(and the same names in a config file), --help that reads like vLLM's, and one-line errors."""

import json
import shutil

import pytest
import yaml

from specray.entrypoints.cli import build_parser, main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def own_checkpoint(tmp_path_factory, demo_pair) -> str:
    """A user's own checkpoint: one directory with the weights and the tokenizer (the demo
    target's), under a name of its own."""
    root = tmp_path_factory.mktemp("user") / "my-coder"
    shutil.copytree(demo_pair.target, root)
    for f in (p for p in __import__("pathlib").Path(demo_pair.tokenizer).iterdir() if p.is_file()):
        shutil.copy(f, root / f.name)
    return str(root)


# -- generate ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_generate_json_default_is_draft_self_tuned(demo_pair, capsys):
    code, out, _ = run(capsys, "generate", "--prompt", "def fibonacci(n):", "--max-tokens", "12", "--json")
    assert code == 0
    out = json.loads(out)
    assert out["method"] == "draft" and out["metrics"]["num_drafts"] > 0  # the demo pair has a draft
    assert len(out["token_ids"]) == 12 or out["finish_reason"] == "stop"


@pytest.mark.slow
def test_generate_with_a_json_schema(demo_pair, tmp_path, capsys):
    """--json-schema FILE: the text parses and matches the schema, under the default method; a
    schema that does not compile is exit 2 naming the flag, one line."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["function", "class"]}, "pure": {"type": "boolean"}},
              "required": ["kind", "pure"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    code, out, err = run(capsys, "generate", "--prompt", "def f(x): return x\n# as JSON: ", "--json-schema", str(path),
                         "--max-tokens", "40", "--json")
    assert code == 0, err
    reply = json.loads(out)
    value = json.loads(reply["text"])
    assert set(value) == {"kind", "pure"} and value["kind"] in ("function", "class") and isinstance(value["pure"], bool)
    assert reply["finish_reason"] == "stop" and reply["method"] == "draft"
    path.write_text(json.dumps({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}))
    code, _, err = run(capsys, "generate", "--prompt", "x", "--json-schema", str(path))
    assert code == 2 and err.count("\n") == 1 and "--json-schema" in err and "invalid json" in err, err


@pytest.mark.slow
def test_generate_with_only_target_dir_uses_prompt_lookup(own_checkpoint, capsys):
    """--target DIR alone: no draft, so the default is prompt lookup; output = plain decoding's."""
    common = ["generate", "--prompt", "import os\nimport sys\n", "--max-tokens", "24", "--json",
              "--target", own_checkpoint]
    code, out, err = run(capsys, *common)
    assert code == 0, err
    spec = json.loads(out)
    assert spec["method"] == "ngram"
    code, out, _ = run(capsys, *common, "--method", "none")
    assert code == 0 and json.loads(out)["token_ids"] == spec["token_ids"]


@pytest.mark.slow
def test_generate_config_file_and_flags_override(demo_pair, tmp_path, capsys):
    """generate --config takes the serve config's names; --dtype and --tokenizer flags override it."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"target": demo_pair.target, "tokenizer": "/does/not/exist", "dtype": "float16",
                                   "speculative-config": {"method": "ngram", "num_speculative_tokens": 3}}))
    code, _, err = run(capsys, "generate", "--prompt", "x", "--config", str(cfg))
    assert code == 2 and "--tokenizer /does/not/exist: no such directory" in err  # the file's value, named as its flag
    code, out, err = run(capsys, "generate", "--prompt", "def f(x):", "--max-tokens", "8", "--json", "--config", str(cfg),
                         "--tokenizer", demo_pair.tokenizer, "--dtype", "float32")
    assert code == 0, err
    out = json.loads(out)
    assert out["method"] == "ngram"  # the file's speculative-config is the default
    assert out["metrics"]["num_drafts"] == 0 or max(len(out["metrics"]["accepted_per_pos"]), 0) <= 3


@pytest.mark.slow
def test_step_flag_runs_the_static_step_with_the_same_output(demo_pair, capsys):
    """--step static (the fixed-shape step that CUDA graphs and torch.compile capture) gives the
    eager step's tokens; --enforce-eager is vLLM's name for eager."""
    common = ["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "16", "--json", "--method", "draft"]
    outs = []
    for extra in (["--enforce-eager"], ["--step", "static"]):
        code, out, err = run(capsys, *common, *extra)
        assert code == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_bad_sampling_and_option_values_name_the_flag(capsys):
    for args, words in ((["--max-tokens", "-3"], "--max-tokens -3"), (["--top-p", "1.5"], "--top-p 1.5"),
                        (["--num-speculative-tokens", "0"], "--num-speculative-tokens 0")):
        code, _, err = run(capsys, "generate", "--prompt", "x", "--method", "ngram", *args)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_unknown_method_exits_2(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--method", "bogus")
    assert code == 2 and "unknown speculation method" in err


@pytest.mark.parametrize("argv, words", [
    (["--target", "/no/such/dir"], "--target /no/such/dir: no such directory"),
    (["--method", "draft", "--draft", "/no/draft"], "--draft /no/draft: no such directory"),
    (["--device", "cuda"], "--device cuda: CUDA is not available"),
    (["--device", "tpu"], "--device tpu: use one of"),
    (["--method", "medusa", "--medusa", ".", "--tree", "bogus"], "--tree bogus: unknown tree 'bogus'"),
    (["--method", "medusa"], "--method medusa needs --medusa DIR"),
    (["--method", "eagle", "--eagle", ".", "--dynamic-tree", "--tree", "chain"], "dynamic_tree"),
    (["--enforce-eager", "--step", "compile"], "--enforce-eager runs the eager step, but --step is compile"),
])
def test_errors_are_one_line_naming_the_flag(argv, words, capsys):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, err = run(capsys, "generate", "--prompt", "x", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err, err
    assert "Traceback" not in err and "EngineConfig" not in err


def test_a_flag_of_another_method_is_an_error(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--method", "draft", "--window-size", "3")
    assert code == 2 and "--window-size is an option of lookahead, but the method is draft" in err
    code, _, err = run(capsys, "generate", "--prompt", "x", "--method", "ngram", "--num-beams", "2")
    assert code == 2 and "--num-beams is an option of redrafter" in err


def test_boolean_switches():
    parser = build_parser()[0]
    args = parser.parse_args(["generate", "--prompt", "x", "--method", "eagle", "--dynamic-tree"])
    assert args.spec_dynamic_tree is True
    args = parser.parse_args(["generate", "--prompt", "x", "--method", "lookahead", "--no-shared-pool"])
    assert args.spec_shared_pool is False and args.spec_dynamic_tree is None  # not given: not sent
    with pytest.raises(SystemExit):  # a value after a switch is an error, not "false"
        parser.parse_args(["generate", "--prompt", "x", "--shared-pool", "banana"])


def test_help_names_every_method_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "SPEC_" not in text and "--num-speculative-tokens N" in text
    assert "dflash, draft, dspark, ngram, pard: Draft tokens per step (k) (default: self-tuning)" in text
    acceptance = text[text.index("--acceptance {exact,typical} "):text.index("--posterior-threshold X ", text.index(
        "--acceptance {exact,typical} "))]
    assert all(m in acceptance.split(":")[0] for m in ("eagle", "medusa", "redrafter"))  # every tree method
    start = text.index("--tree NAME eagle")
    tree = text[start:text.index("--eagle-top-k N", start)]
    medusa_part = tree[tree.index("medusa:"):]
    assert "mc_sim_7b_63" in tree[:tree.index("medusa:")] and "mc_sim_7b_63" not in medusa_part
    assert "--dynamic-tree, --no-dynamic-tree" in text and "(default: off)" in text
    assert "--window-size N lookahead: W: Jacobi window columns" in text and "(default: 3)" in text


def test_serve_help_is_grouped_with_vllm_names(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for flag in ("--dtype", "--device", "--max-model-len", "--max-num-seqs", "--gpu-memory-utilization",
                 "--speculative-config JSON", "--served-model-name NAME", "--api-key KEY", "--num-replicas N"):
        assert flag in text, flag
    assert "model:" in text and "server:" in text and "(default: 0.9)" in text


def test_train_and_bench_help_list_what_they_run(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert all(r in text for r in ("medusa", "eagle", "redrafter")) and "recipes:" in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(b in text for b in ("speed", "load", "actors", "trees", "lookahead")) and "benchmarks:" in text
    assert main(["jobs", "--help"]) == 0
    assert "--input FILE" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["draft", "medusa", "eagle", "eagle3", "redrafter", "pard", "dflash", "dspark"])
def test_train_help_shows_every_default(method, capsys):
    """`specray train METHOD --help`: each option that has a default names it (its value as
    the recipe would use it), one with none says what happens instead."""
    import re

    with pytest.raises(SystemExit):
        main(["train", method, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    blocks = re.split(r" (?=--[a-z])", text.split(" options: ", 1)[1])
    for block in blocks:
        words = block.split()
        if block.startswith(("--out ", "--help ", "-h")) or not (words[1].isupper() or words[1].startswith("{")):
            continue  # required, help, a switch (no value: off unless given)
        assert "default" in block, block
    steps = {"draft": 300, "medusa": 1500, "eagle": 1200, "eagle3": 1200, "redrafter": 1000, "pard": 600,
             "dflash": 800, "dspark": 800}[method]
    assert f"--steps STEPS optimizer steps (default: {steps})" in text
    assert "(default: 0)" in text  # a zero default is shown too (--seed)


def test_env_reports_kernel_and_why(capsys):
    code, out, _ = run(capsys, "env")
    assert code == 0
    for word in ("torch", "transformers", "ray", "xformers", "device", "dtype", "attention"):
        assert word in out
    assert "sdpa" in out or "xformers" in out.split("attention")[1]


# -- serve's flags and config file (no server started) ---------------------------------------------
def serve_config(*argv, file_data=None):
    from specray.entrypoints.cli import engine_settings

    args = build_parser()[0].parse_args(["serve", *argv])
    return engine_settings(args, file_data or {})


@pytest.mark.parametrize("argv, path, value", [
    (["--dtype", "bfloat16"], ("engine", "dtype"), "bfloat16"),
    (["--device", "cpu"], ("engine", "device"), "cpu"),
    (["--max-model-len", "512"], ("engine", "max_model_len"), 512),
    (["--max-num-seqs", "3"], ("engine", "max_num_seqs"), 3),
    (["--gpu-memory-utilization", "0.5"], ("engine", "gpu_memory_utilization"), 0.5),
    (["--served-model-name", "coder"], ("model_name",), "coder"),
    (["--api-key", "k1"], ("api_key",), "k1"),
    (["--num-replicas", "2"], ("num_replicas",), 2),
    (["--host", "0.0.0.0", "--port", "9001"], ("port",), 9001),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     ("engine", "default_speculation"), {"method": "ngram", "num_speculative_tokens": 3}),
])
def test_each_serve_flag_sets_its_config(argv, path, value):
    cfg = serve_config(*argv).model_dump()
    for key in path:
        cfg = cfg[key]
    assert cfg == value or (isinstance(value, dict) and value.items() <= cfg.items())


def test_flags_override_the_config_file_with_the_same_names(tmp_path):
    data = {"max-model-len": 256, "served_model_name": "from-file", "max-num-seqs": 2,
            "speculative-config": {"method": "draft", "num_speculative_tokens": 2}}
    cfg = serve_config("--max-model-len", "128", "--speculative-config", '{"method": "ngram"}', file_data=data)
    assert cfg.engine.max_model_len == 128 and cfg.engine.max_num_seqs == 2 and cfg.model_name == "from-file"
    assert cfg.engine.default_speculation.method == "ngram"
    assert cfg.engine.default_speculation.model_fields_set == {"method"}  # the length stays self-tuning


def test_the_online_learning_switch_keeps_the_files_settings():
    cfg = serve_config("--online-learning", file_data={"online_learning": {"round_requests": 8, "steps": 10}})
    learning = cfg.engine.online_learning
    assert (learning.enabled, learning.round_requests, learning.steps) == (True, 8, 10)


def test_speculative_config_model_is_the_methods_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = serve_config("--speculative-config", json.dumps({"method": "draft_model", "model": str(tmp_path)}))
    assert cfg.engine.draft == str(tmp_path) and cfg.engine.default_speculation.method == "draft"
    cfg = serve_config("--speculative-config", json.dumps({"method": "eagle", "model": str(tmp_path), "top_k": 4}))
    assert cfg.engine.checkpoints == {"eagle": str(tmp_path)} and cfg.engine.default_speculation.top_k == 4


@pytest.mark.parametrize("argv, words", [
    (["--speculative-config", "{bad"], "--speculative-config: not JSON"),
    (["--speculative-config", '{"method": "ngram", "model": "/x"}'], "loads no weights"),
    (["--speculative-config", '{"method": "draft", "num_speculative_tokens": 0}'], "num_speculative_tokens"),
    (["--max-model-len", "1"], "--max-model-len 1: Input should be greater than or equal to 2"),
    (["--dtype", "float64"], None),
    (["--target", "/no/where"], "--target /no/where: no such directory"),
])
def test_serve_flag_errors_are_one_line(argv, words, capsys):
    if words is None:  # argparse's own choice check
        with pytest.raises(SystemExit):
            serve_config(*argv)
        return
    with pytest.raises(ValueError) as info:
        serve_config(*argv)
    from specray.entrypoints.flags import one_line

    line = one_line(info.value)
    assert words in line and "\n" not in line, line


@pytest.mark.parametrize("argv, hint", [
    (["serve", "--max-model-length", "512"], "did you mean --max-model-len?"),
    (["generate", "--prompt", "x", "--max-tokns", "3"], "did you mean --max-tokens?"),
    (["train", "eagle", "--out", "x", "--stepz", "3"], "did you mean --steps?"),
])
def test_an_unknown_flag_names_the_closest_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and hint in err.splitlines()[-1], err


def test_served_name_defaults_to_the_target_directory(tmp_path):
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")
    assert serve_config("--target", str(tmp_path / "my-model")).model_name == "my-model"
    assert serve_config().model_name == "specray-demo"


@pytest.mark.slow
def test_generate_medusa_and_eagle_equal_plain(demo_pair, tmp_path, capsys):
    """Random heads on the demo target: whatever they guess, greedy output is the target's."""
    import torch

    from specray.training.eagle import head_config
    from specray.policies.eagle import EagleHead
    from tests.test_medusa import random_heads

    random_heads(hidden=64, vocab=2048).save(tmp_path / "medusa")
    torch.manual_seed(0)
    head = EagleHead(head_config(demo_pair.target))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    head.save(tmp_path / "eagle")
    common = ["generate", "--prompt", "import os\n", "--max-tokens", "16", "--json"]
    code, out, _ = run(capsys, *common, "--method", "none")
    plain = json.loads(out)
    for extra in (["--method", "medusa", "--medusa", str(tmp_path / "medusa"), "--tree", "wide"],
                  ["--method", "eagle", "--eagle", str(tmp_path / "eagle"), "--tree", "chain"],
                  ["--method", "eagle", "--eagle", str(tmp_path / "eagle"), "--dynamic-tree", "--eagle-top-k", "3",
                   "--depth", "3"]):
        code, out, err = run(capsys, *common, *extra)
        assert code == 0, err
        spec = json.loads(out)
        assert spec["token_ids"] == plain["token_ids"] and spec["metrics"]["num_drafts"] > 0, extra
