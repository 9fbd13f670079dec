"""The README and docs/ say what runs: Python snippets import what they use (the Ray snippet and
the in-process one run on the demo pair), every command line names flags its command has and
files the repository has, the JSON requests and speculation settings pass the checks a server
applies, and the serve synopsis names every serve flag."""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import io
import json
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "methods").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def blocks(path: pathlib.Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def block_with(path: pathlib.Path, language: str, marker: str) -> str:
    (found,) = [b for b in blocks(path, language) if marker in b]
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


def commands(path: pathlib.Path) -> list[list[str]]:
    """Each shell command of the page's bash blocks, as words (continuations joined, comments cut)."""
    out = []
    for block in blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # a synopsis line with an unbalanced quote is never a command to run
                continue
            for part in " ".join(shlex.quote(w) for w in words).split(" && "):
                if part.strip():
                    out.append(shlex.split(part))
    return out


@functools.cache
def help_flags(kind: str, name: str) -> frozenset[str]:
    """The flags a command knows: its parser's, or (benchmarks, recipes) what its --help lists."""
    from specray.engine.argparsing import known_flags

    if kind in ("serve", "generate", "env", "demo-models"):
        from specray.entrypoints.cli import build_parser

        parser = build_parser()[0]
        return frozenset(known_flags(parser, parser.parse_known_args([kind, *(["--prompt", "x"] * (kind == "generate"))])[0]))
    if kind == "jobs":
        from specray.entrypoints.jobs import build_parser

        return frozenset(known_flags(build_parser()))
    import importlib

    main = {"train": lambda: importlib.import_module("specray.training.recipes").recipes()[name],
            "bench": lambda: importlib.import_module(f"specray.bench.{name}").main,
            "demo": lambda: importlib.import_module("specray.demo.cli").main}[kind]()
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        main(["--help"])
    return frozenset(FLAG.findall(text.getvalue()))


def our_command(words: list[str]) -> tuple[str, str] | None:
    """(kind, name) of a specray command line, or None for another program's."""
    while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value before the command
        words = words[1:]
    if "python" in words[:1] or words[:1] == ["python3"] or words[:2] == ["ray", "job"]:
        module = next((w for w, prev in zip(words[1:], words) if prev == "-m"), "")
        if module == "specray.entrypoints.jobs":
            return "jobs", ""
        if module.startswith("specray.bench."):
            return "bench", module.rsplit(".", 1)[1]
        if module == "specray.demo":
            return "demo", ""
        return None
    if words[:1] != ["specray"] or len(words) < 2:
        return None
    if words[1] in ("train", "bench"):
        name = words[2] if len(words) > 2 else ""
        return (words[1], name) if re.fullmatch(r"[a-z0-9_]+", name) else None  # a synopsis names alternatives
    return words[1], ""


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_command_line_names_flags_its_command_has(page):
    for words in commands(page):
        found = our_command(words)
        if found is None:
            continue
        known = help_flags(*found)
        unknown = [f for f in FLAG.findall(" ".join(words)) if f not in known]
        assert not unknown, (page.name, " ".join(words), unknown)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_files_the_pages_name_exist(page):
    """Repository files a command reads (``serve run examples/serve.yaml``, ``ray up cluster/...``)."""
    for words in commands(page):
        for word in words:
            if re.fullmatch(r"(examples|cluster|bench|tests|docs)/[\w./-]+\.\w+", word):
                assert (ROOT / word).is_file(), (page.name, word)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_python_snippets_import_what_they_use(page):
    """Every name a snippet reads is imported or defined in it, and no line — code or comment —
    reaches a specray module it did not import."""
    for code in blocks(page, "python"):
        assert not unbound_names(code), (page.name, unbound_names(code), code[:200])
        for line in code.splitlines():
            if not line.lstrip().startswith(("import ", "from ")):
                assert "specray." not in line, (page.name, line)


def json_values(text: str) -> list:
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        value, i = decoder.raw_decode(text, i)
        out.append(value)
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_json_requests_and_speculation_settings_are_valid(page):
    """A request body passes the server's one request check; a speculation setting parses as its
    method's options (batch lines: the test below, on the demo pair)."""
    from specray.policies.registry import method_spec, parse_speculation
    from specray.protocol import checks as C

    for block in blocks(page, "json"):
        for value in json_values(block):
            if "custom_id" in value or "num_drafted" in value:  # batch lines below; a playground event
                continue
            if "prompt" in value or "messages" in value:
                C.parse(value, "messages" in value)
                if "speculation" in value:
                    parse_speculation(value["speculation"])
            elif "method" in value:
                options = parse_speculation(value)
                method_spec(options.method)


def test_the_serve_synopsis_names_every_serve_flag():
    from specray.entrypoints.cli import build_parser

    text = block_with(ROOT / "docs" / "cli.md", "bash", "specray serve [")
    synopsis = text[text.index("specray serve ["):text.index("specray generate")]
    named = set(FLAG.findall(synopsis))
    parser = build_parser()[0]
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    for action in sub.choices["serve"]._actions:
        if action.option_strings and "--help" not in action.option_strings:
            assert named & set(action.option_strings), action.option_strings


def test_the_readme_stays_a_manual():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "pip install torch==2.13.0 && pip install -e . && specray serve --once" in text


@pytest.mark.slow  # runs git
def test_no_code_names_a_commit():
    """History is git's: no Python file carries a commit id (a 7-40 hex token that begins a commit)."""
    import re
    import shutil
    import subprocess

    root = README.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    commits = subprocess.run(["git", "rev-list", "--all"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    tokens = {(f, t) for f in files for t in re.findall(r"\b[0-9a-f]{7,40}\b", (root / f).read_text(errors="replace"))}
    named = sorted((f, t) for f, t in tokens if any(c.startswith(t) for c in commits))
    assert not named, named


@pytest.mark.slow
def test_the_in_process_snippet_runs_as_written(capsys):
    code = block_with(README, "python", "LLMEngine(")
    exec(compile(code, "README.md", "exec"), {})  # noqa: S102
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_the_coordinator_snippet_runs_as_written(ray_session, demo_pair, capsys):
    """The Ray section's snippet, run as it is (its ``ray.init()`` aside: this run's Ray is up)."""
    import ray

    code = block_with(README, "python", "Coordinator.remote")
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


@pytest.mark.slow
def test_the_openai_batch_example_is_valid_and_bounded(demo_pair):
    """The OpenAI batch lines pass the job's checks on the demo pair, each asking for a bounded answer."""
    from specray.actors.config import SpecrayConfig
    from specray.entrypoints import jobs, openai_batch

    (page,) = [p for p in PAGES if any('"custom_id"' in b for b in blocks(p, "json"))]
    lines = [json.loads(line) for line in block_with(page, "json", '"custom_id"').splitlines() if line.strip()]
    facts = jobs._batch_facts(SpecrayConfig())
    assert {line["url"] for line in lines} == {"/v1/completions", "/v1/chat/completions"}
    for line in lines:
        request, problems = openai_batch.check_line(line, facts)
        assert not problems, problems
        assert all(s.max_tokens <= 64 for choices in request.checked.samplings for s in choices), line
