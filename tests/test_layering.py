"""The layering docs/architecture.md states is true: nothing imports upward (module-level or inside functions).

    kernels <- policies <- engine <- cluster <- actors <- serve <- entrypoints <- bench
                            engine <- protocol  (OpenAI's shapes and the one request check:
                                                 serve and entrypoints share it)
                            engine <- training  (a side folder: only entrypoints and bench import it)

``bench`` drives the whole stack (``specray bench NAME`` runs a benchmark by its name) and trains
the heads it measures (training/recipes.py).

``cluster`` (where specray meets a Ray cluster: the deployment manifests, placement by role)
imports only the engine and below.

``demo`` (the built-in model pair) imports no other specray package, and only entrypoints
(the demo-pair default), bench and training use it: actors and the engine never build models.
Each package may import the ones listed for it and itself, nothing else.
"""

import ast
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BELOW = {
    "kernels": set(),
    "policies": {"kernels"},
    "engine": {"kernels", "policies"},
    "protocol": {"kernels", "policies", "engine"},
    "cluster": {"kernels", "policies", "engine"},
    "actors": {"kernels", "policies", "engine", "cluster"},
    "serve": {"kernels", "policies", "engine", "protocol", "actors", "cluster"},
    "training": {"kernels", "policies", "engine", "demo"},
    "entrypoints": {"kernels", "policies", "engine", "protocol", "actors", "cluster", "serve", "training", "demo"},
    "bench": {"kernels", "policies", "engine", "protocol", "actors", "cluster", "serve", "entrypoints", "training", "demo"},
    "demo": set(),
}


def imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "specray" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(BELOW))
def test_no_upward_imports(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for dep in imported_packages(path) - {package}:
            if dep not in BELOW[package]:
                bad.append(f"{path.relative_to(ROOT)} imports specray.{dep}")
    assert not bad, "\n".join(bad)


def test_every_code_folder_is_a_layer_and_a_listed_package():
    """A root folder with Python code is in the layering above and in pyproject's package list
    (a non-editable wheel holds only the packages listed)."""
    folders = {p.parent.relative_to(ROOT).parts[0] for p in ROOT.glob("*/**/*.py")}
    folders -= {"tests", "specray", ".venv", "build"}
    assert folders == set(BELOW), folders ^ set(BELOW)
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(tool["packages"])
    for path in ROOT.glob("*/**/__init__.py"):
        rel = path.parent.relative_to(ROOT)
        if rel.parts[0] in BELOW:
            assert "specray." + ".".join(rel.parts) in packages, rel
            assert tool["package-dir"]["specray." + rel.parts[0]] == rel.parts[0]


def _walk_outside_main(tree):
    """Every node except those under ``if __name__ == "__main__":`` (a script's own start)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"':
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def test_no_import_cycles_between_modules():
    """Modules do not import each other in a circle (a function-level import counts too)."""
    graph: dict[str, set[str]] = {}
    for package in BELOW:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            module = "specray." + ".".join(parts)
            deps = set()
            for node in _walk_outside_main(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    deps.add(node.module)
                    deps.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names)
            graph[module] = deps
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    # A package's __init__ importing its own modules (registration) is not a circle of modules.
    for m in graph:
        graph[m] = {d for d in graph[m] if not (m.startswith(d + ".") and d.count(".") == 1)}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("folder", sorted(BELOW))
def test_the_root_folders_import_only_as_specray(folder):
    """Under the test command the root is not on sys.path: ``import engine`` fails, so no module
    is ever loaded twice under two names (``engine.config`` beside ``specray.engine.config``)."""
    import importlib
    import sys

    assert not any(pathlib.Path(p or ".").resolve() == ROOT for p in sys.path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(folder)
    assert importlib.import_module(f"specray.{folder}").__name__ == f"specray.{folder}"
