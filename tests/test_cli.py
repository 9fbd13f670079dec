"""The specray command: generate on the demo pair, and clear errors for bad input."""

import json

import pytest

from specray.cluster.cli import main


@pytest.mark.slow
def test_generate_json(demo_pair, capsys):
    code = main(["generate", "--prompt", "def fibonacci(n):", "--method", "draft", "--num-speculative-tokens", "3",
                 "--max-tokens", "12", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12 or out["finish_reason"] == "stop"
    assert isinstance(out["text"], str) and out["metrics"]["target_forward_passes"] >= 2


@pytest.mark.slow
def test_demo_models_prints_paths(demo_pair, capsys):
    assert main(["demo-models"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {"target", "draft", "tokenizer"} <= set(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "-3"], "max_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--num-speculative-tokens", "0"], "num_speculative_tokens"),
    ],
)
def test_bad_parameters_exit_2(args, message, capsys):
    assert main(["generate", "--prompt", "x", *args]) == 2
    assert message in capsys.readouterr().err


def test_unknown_method_exits_2(capsys):
    assert main(["generate", "--prompt", "x", "--method", "bogus"]) == 2
    assert "unknown speculation method" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_medusa_equals_plain(demo_pair, tmp_path, capsys):
    """Random heads on the demo target: whatever they guess, greedy output is the target's."""
    from tests.test_medusa import random_heads

    random_heads(hidden=64, vocab=2048).save(tmp_path)
    common = ["generate", "--prompt", "import os\n", "--max-tokens", "16", "--json"]
    assert main([*common, "--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*common, "--method", "medusa", "--medusa", str(tmp_path), "--tree", "wide"]) == 0
    medusa = json.loads(capsys.readouterr().out)
    assert medusa["token_ids"] == plain["token_ids"] and medusa["metrics"]["num_drafts"] > 0


def test_medusa_flags_are_checked(capsys):
    with pytest.raises(SystemExit, match="needs --medusa"):
        main(["generate", "--prompt", "x", "--method", "medusa"])
    assert main(["generate", "--prompt", "x", "--method", "medusa", "--medusa", "/x", "--tree", "bushy"]) == 2
    assert "unknown tree" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_eagle_equals_plain(demo_pair, tmp_path, capsys):
    """A random EAGLE head on the demo target, static and dynamic trees: the target's output."""
    import torch

    from specray.cluster.train_eagle import head_config
    from specray.policies.eagle import EagleHead

    torch.manual_seed(0)
    head = EagleHead(head_config(demo_pair.target))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    head.save(tmp_path)
    common = ["generate", "--prompt", "import os\n", "--max-tokens", "16", "--json"]
    assert main([*common, "--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    for extra in (["--tree", "chain"], ["--dynamic-tree", "true", "--eagle-top-k", "3", "--depth", "3"]):
        assert main([*common, "--method", "eagle", "--eagle", str(tmp_path), *extra]) == 0
        eagle = json.loads(capsys.readouterr().out)
        assert eagle["token_ids"] == plain["token_ids"] and eagle["metrics"]["num_drafts"] > 0, extra


def test_eagle_flags_are_checked(capsys):
    with pytest.raises(SystemExit, match="needs --eagle"):
        main(["generate", "--prompt", "x", "--method", "eagle"])
    assert main(["generate", "--prompt", "x", "--method", "eagle", "--eagle", "/x", "--dynamic-tree", "true",
                 "--tree", "chain"]) == 2
    assert "dynamic_tree" in capsys.readouterr().err
