"""The README's layering is true: nothing imports upward (module-level or inside functions).

kernels <- policies <- engine <- actors <- serve <- bench <- cluster (the entry points:
CLI, jobs, training; ``specray bench`` runs the benchmarks). ``demo`` (the built-in model pair) imports no other
specray package, and only entry points may use it (actors' config, serve, cluster, bench):
the engine never builds models itself.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ["kernels", "policies", "engine", "actors", "serve", "bench", "cluster"]
USES_DEMO = {"actors", "serve", "cluster", "bench"}


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


@pytest.mark.parametrize("package", ORDER + ["demo"])
def test_no_upward_imports(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for dep in imported_packages(path):
            if package == "demo":
                ok = dep == "demo"
            elif dep == "demo":
                ok = package in USES_DEMO
            else:
                ok = dep in ORDER and ORDER.index(dep) <= ORDER.index(package)
            if not ok:
                bad.append(f"{path.relative_to(ROOT)} imports specray.{dep}")
    assert not bad, "\n".join(bad)
