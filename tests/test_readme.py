"""The README's examples do what it says: its Python runs as written, its synopsis names every
flag, its OpenAI batch example asks for a bounded answer."""

from __future__ import annotations

import ast
import builtins
import json
import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language``."""
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def block_with(language: str, marker: str) -> str:
    (found,) = [b for b in blocks(language) if marker in b]
    return found


def unbound_names(code: str) -> set[str]:
    """Names a snippet reads that neither it nor Python defines."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            bound |= {a.arg for a in node.args.args} if not isinstance(node, ast.ClassDef) else set()
        elif isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
    return read - bound


def test_python_snippets_import_what_they_use():
    """Every name a snippet reads is imported or defined in it, and no line — code or comment —
    reaches a specray module it did not import (the Coordinator snippet once said
    ``specray.entrypoints.defaults.with_demo_pair`` without importing it)."""
    snippets = blocks("python")
    assert len(snippets) >= 3
    for code in snippets:
        assert not unbound_names(code), (unbound_names(code), code[:200])
        for line in code.splitlines():
            if not line.lstrip().startswith(("import ", "from ")):
                assert "specray." not in line, line


@pytest.mark.slow
def test_the_coordinator_snippet_runs_as_written(ray_session, demo_pair, capsys):
    """The Ray section's snippet, run as it is (its ``ray.init()`` aside: this run's Ray is up)."""
    import ray

    code = block_with("python", "Coordinator.remote")
    assert "ray.init()\n" in code
    scope: dict = {}
    try:
        exec(compile(code.replace("ray.init()\n", ""), "README.md", "exec"), scope)  # noqa: S102
    finally:
        if "coordinator" in scope:
            ray.kill(scope["coordinator"])
    out = scope["outs"][0]
    assert out["finished"] and 0 < len(out["token_ids"]) <= 32 and out["metrics"]["num_drafts"] > 0
    streamed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert streamed and sum(len(json.loads(line)) for line in streamed) <= 16


def test_serve_synopsis_names_every_serve_flag():
    """The Command line section's ``specray serve`` lines name each of its flags (--eagle3 was missing)."""
    from specray.entrypoints.cli import build_parser

    text = block_with("bash", "specray serve [")
    synopsis = text[text.index("specray serve ["):text.index("specray generate")]
    named = set(re.findall(r"--[a-z0-9-]+", synopsis))
    parser = build_parser()[0]
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    for action in sub.choices["serve"]._actions:
        if action.option_strings and "--help" not in action.option_strings:
            assert named & set(action.option_strings), action.option_strings


@pytest.mark.slow
def test_the_openai_batch_example_is_valid_and_bounded(demo_pair):
    """The README's OpenAI batch lines pass the job's checks on the demo pair, and each asks
    for a bounded answer (the chat line once gave no max_tokens: it ran to the end of the
    context, 1,239 tokens of noise)."""
    from specray.actors.config import SpecrayConfig
    from specray.entrypoints import jobs, openai_batch

    lines = [json.loads(line) for line in block_with("json", '"custom_id"').splitlines() if line.strip()]
    facts = jobs._batch_facts(SpecrayConfig())
    assert {line["url"] for line in lines} == {"/v1/completions", "/v1/chat/completions"}
    for line in lines:
        request, problems = openai_batch.check_line(line, facts)
        assert not problems, problems
        assert all(s.max_tokens <= 64 for choices in request.checked.samplings for s in choices), line
