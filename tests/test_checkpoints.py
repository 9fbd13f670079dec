"""Weights checked before anything starts (engine/checkpoints.py): each method's layout, sizes
that fit the target, whole draft models, from configs and tensor headers — and the command
line's one line naming the flag, exit 2, before Ray starts."""

from __future__ import annotations

import json

import pytest
import torch

from specray.engine.checkpoints import checkpoint_problems, problems_line
from specray.engine.config import EngineConfig
from specray.policies.registry import parse_speculation
from tests.conftest import free_port, tiny_llama
from tests.test_eagle import random_head
from tests.test_eagle3 import random_head3
from tests.test_medusa import random_heads
from tests.test_redrafter import random_drafter


@pytest.fixture(scope="module")
def dirs(tiny_tok, tiny_pair, tmp_path_factory) -> dict:
    """The tiny pair with its tokenizer, and a head of every method for its target."""
    root = tmp_path_factory.mktemp("checkpoints")
    target = tiny_pair[0]
    random_head(target).save(root / "eagle")
    random_head3(target).save(root / "eagle3")
    random_heads().save(root / "medusa")
    random_drafter().save(root / "redrafter")
    return {**tiny_tok, **{m: str(root / m) for m in ("eagle", "eagle3", "medusa", "redrafter")}, "root": root}


def problems(dirs, **given) -> list:
    config = EngineConfig(target=given.pop("target", dirs["target"]), tokenizer=dirs["tokenizer"],
                          draft=given.pop("draft", None), medusa=given.pop("medusa", None),
                          default_speculation=given.pop("default_speculation", None), checkpoints=given)
    return checkpoint_problems(config)


def test_every_method_that_fits_passes(dirs):
    assert problems(dirs, draft=dirs["draft"], medusa=dirs["medusa"], eagle=dirs["eagle"], eagle3=dirs["eagle3"],
                    redrafter=dirs["redrafter"]) == []


def test_a_head_passed_as_another_methods_weights_is_named_with_the_right_flag(dirs):
    (p,) = problems(dirs, draft=dirs["eagle"])
    assert p.key == "draft" and "weights are missing" in p.message and "pass it with --eagle" in p.message
    (p,) = problems(dirs, eagle=dirs["draft"])
    assert p.key == "eagle" and "EAGLE head" in p.message and "pass it with --draft" in p.message
    (p,) = problems(dirs, eagle=dirs["tokenizer"])  # no head at all
    assert "config.json not found: not an EAGLE head directory" in p.message
    line = problems_line(problems(dirs, eagle=dirs["tokenizer"], redrafter=dirs["medusa"]))
    assert line.startswith(f"--eagle {dirs['tokenizer']}: ") and f"; --redrafter {dirs['medusa']}: " in line
    assert "\n" not in line


def test_sizes_must_fit_the_target(dirs):
    root = dirs["root"]
    random_heads(hidden=48).save(root / "medusa-48")
    (p,) = problems(dirs, medusa=str(root / "medusa-48"))
    assert "hidden size 48" in p.message and "32" in p.message
    tiny_llama(vocab=32, layers=1).save_pretrained(root / "draft-32")  # the tokenizer makes 64 ids
    (p,) = problems(dirs, draft=str(root / "draft-32"))
    assert "vocabulary has 32 tokens" in p.message and "ids up to 63" in p.message
    tiny_llama(vocab=80, layers=1).save_pretrained(root / "draft-80")  # padded: fine
    assert problems(dirs, draft=str(root / "draft-80")) == []


def test_a_draft_with_a_weight_missing_or_misshapen_is_refused(dirs):
    from safetensors.torch import load_file, save_file

    root = dirs["root"]
    tiny_llama(layers=1).save_pretrained(root / "draft-cut")
    weights = root / "draft-cut" / "model.safetensors"
    state = load_file(str(weights))
    save_file({k: v for k, v in state.items() if "mlp.up_proj" not in k}, str(weights), metadata={"format": "pt"})
    (p,) = problems(dirs, draft=str(root / "draft-cut"))
    assert "1 of" in p.message and "model.layers.0.mlp.up_proj.weight" in p.message
    state["model.norm.weight"] = torch.ones(7)
    save_file(state, str(weights), metadata={"format": "pt"})
    (p,) = problems(dirs, draft=str(root / "draft-cut"))
    assert "model.norm.weight is [7], the config needs [32]" in p.message


def test_heads_as_torch_pickles_are_checked_without_loading_them(dirs, tmp_path):
    from safetensors.torch import load_file

    for name in ("config.json",):
        (tmp_path / name).write_text((dirs["root"] / "eagle" / name).read_text())
    torch.save(load_file(str(dirs["root"] / "eagle" / "model.safetensors")), tmp_path / "pytorch_model.bin")
    assert problems(dirs, eagle=str(tmp_path)) == []


def test_a_default_method_without_its_weights_is_a_problem(dirs):
    (p,) = problems(dirs, default_speculation=parse_speculation({"method": "eagle"}))
    assert p.key == "default_speculation" and "needs an EAGLE head" in p.message
    assert problems_line([p]).startswith("--speculative-config: method 'eagle' needs an EAGLE head")


def run_cli(capsys, *args: str) -> tuple[int, str]:
    """The command line in this process (exit code, stderr): the one-line errors come before Ray."""
    from specray.entrypoints.cli import main

    code = main(list(args))
    return code, capsys.readouterr().err


def test_the_command_line_says_one_line_and_exits_2_before_ray_starts(dirs, tmp_path, no_ray, capsys):
    model = ["--target", dirs["target"], "--tokenizer", dirs["tokenizer"]]
    code, err = run_cli(capsys, "generate", "--prompt", "abc", *model, "--eagle", dirs["tokenizer"], "--method", "eagle")
    assert code == 2 and "Traceback" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("specray generate: error:")]
    assert f"--eagle {dirs['tokenizer']}: config.json not found: not an EAGLE head directory" in line
    code, err = run_cli(capsys, "serve", *model, "--draft", dirs["eagle"], "--port", str(free_port()))
    assert code == 2 and "--draft" in err and "pass it with --eagle" in err, err
    code, err = run_cli(capsys, "serve", *model, "--speculative-config", '{"method": "eagle"}')
    assert code == 2 and "--speculative-config: method 'eagle' needs an EAGLE head" in err, err
    spec = json.dumps({"method": "redrafter", "model": dirs["eagle"]})
    code, err = run_cli(capsys, "serve", *model, "--speculative-config", spec)
    assert code == 2 and f"--speculative-config model {dirs['eagle']}: " in err, err
    config = tmp_path / "job.yaml"
    config.write_text(f"target: {dirs['target']}\ntokenizer: {dirs['tokenizer']}\ndraft: {dirs['medusa']}\n")
    (tmp_path / "in.jsonl").write_text('{"prompt": "abc"}\n')
    code, err = run_cli(capsys, "jobs", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                        "--config", str(config))
    assert code == 2 and f"draft: {dirs['medusa']}: " in err and "Medusa heads" in err, err


@pytest.fixture()
def no_ray(monkeypatch):
    """A start that reaches Ray fails the test: these mistakes are caught before it."""
    import ray

    def started(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "init", started)


def one_error_line(capsys, command: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"specray {command}: error: "), err
    return err[0]


def test_start_up_mistakes_are_one_line_exit_2_before_ray(dirs, tmp_path, no_ray, capsys):
    from specray.entrypoints.cli import main
    from tests.test_dflash import random_drafter
    from tests.test_pard import pard_model

    model = ["--target", dirs["target"], "--tokenizer", dirs["tokenizer"], "--port", str(free_port())]
    random_drafter(tiny_llama(layers=2), block=6).save(tmp_path / "dflash")
    spec = json.dumps({"method": "dflash", "model": str(tmp_path / "dflash"), "num_speculative_tokens": 8})
    assert main(["serve", *model, "--speculative-config", spec]) == 2
    line = one_error_line(capsys, "serve")
    assert "--speculative-config" in line and "8 exceeds the 5 tokens a DFlash block of 6 drafts" in line

    pard_model(tiny_llama(layers=1, seed=1)).save_pretrained(tmp_path / "pard")
    assert main(["serve", *model, "--dflash", str(tmp_path / "pard")]) == 2
    line = one_error_line(capsys, "serve")
    assert f"--dflash {tmp_path / 'pard'}: " in line and "pass it with --pard" in line

    assert main(["serve", *model, "--eagle", dirs["draft"]]) == 2
    line = one_error_line(capsys, "serve")
    assert "pass it with --draft" in line and "fc.weight" in line and "state_dict" not in line

    bare = tmp_path / "no-tokenizer"
    tiny_llama(layers=2).save_pretrained(bare)
    for command in (["serve", "--port", str(free_port())], ["generate", "--prompt", "abc"]):
        assert main([command[0], "--target", str(bare), *command[1:]]) == 2
        line = one_error_line(capsys, command[0])
        assert f"--target {bare} has no tokenizer" in line and "--tokenizer DIR" in line
