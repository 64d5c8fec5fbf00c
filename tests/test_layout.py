"""The shape of the code, checked: no import circle in ``app/``, front ends that do not
import each other, an engine that knows nothing of the process's settings."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph(package: str = "app") -> dict[str, set[str]]:
    """Every module of ``package`` and the modules of it that it imports (at any depth of its
    code: a deferred import is still an import). ``from pkg import name`` points at
    ``pkg.name`` when that is a module, else at ``pkg``."""
    paths = {module_name(path): path for path in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    found.add(target if target in paths else node.module)
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {target for target in found if target in paths and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_the_application() -> None:
    assert circles(import_graph()) == []


def test_a_circle_is_found_where_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_front_ends_do_not_import_each_other() -> None:
    graph = import_graph()
    for name, targets in graph.items():
        for front, other in (("app.http", "app.grpc"), ("app.grpc", "app.http")):
            if name.startswith(front):
                crossing = {target for target in targets if target.startswith(other)}
                assert not crossing, f"{name} imports {crossing}"


def test_the_engine_knows_nothing_of_the_process_settings() -> None:
    """A model's engine is built from its ``ModelConfig`` alone."""
    for name, targets in import_graph().items():
        if name.startswith("app.engine"):
            assert "app.settings" not in targets, f"{name} imports app.settings"


def test_benchmarks_and_the_harness_use_the_engines_public_surface() -> None:
    """They import ``app.engine`` itself, never one of its modules: the engine's shape can
    change beneath them."""
    for package in ("benchmarks", "harness"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                inside = [name for name in names if name.startswith("app.engine.")]
                assert not inside, f"{path.relative_to(ROOT)} imports {inside}"
