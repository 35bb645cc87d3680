"""The packages import downwards only: no cycle between tokenyard's packages, lazy imports
included (a function-level import is still a dependency), and the library never imports a
service, except the `tokenyard` command's modules, which start services when they run."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"shared": "tokenyard", "services": "tokenyard.services", "kernels": "tokenyard.kernels"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str | None:
    """tokenyard.engine.config -> engine; tokenyard.services.worker.base -> services.worker."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "v1":  # generated protobuf code: a leaf
        return None
    if parts[1] == "services":
        return ".".join(parts[1:3]) if len(parts) > 2 else None
    return parts[1]


def imports(tree: ast.Module) -> Iterator[str]:
    """Every module an import names, at any depth, except under `if TYPE_CHECKING:`."""
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            source = package_of(module_name(path))
            if source is None:
                continue
            for name in imports(ast.parse(path.read_text())):
                target = package_of(name) if name.startswith("tokenyard.") else None
                if target is not None and target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if cycle := visit(nxt, [*path, node]):
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if cycle := visit(start, []):
            return cycle
    return None


def test_the_package_graph_is_read():
    graph = package_graph()
    assert "models" in graph["engine"] and "engine" in graph["services.worker"]


def test_no_import_cycle_between_packages():
    assert find_cycle(package_graph()) is None


def test_a_cycle_is_found_when_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_library_imports_no_service_but_the_command():
    graph = package_graph()
    offenders = {
        source: sorted(t for t in targets if t.startswith("services."))
        for source, targets in graph.items()
        if not source.startswith("services.") and source != "cli"
    }
    assert {source: t for source, t in offenders.items() if t} == {}


def test_models_and_kv_never_import_the_engine_and_platforms_imports_nothing():
    graph = package_graph()
    assert "engine" not in graph.get("models", set())
    assert "engine" not in graph.get("kv", set())
    assert graph.get("platforms", set()) == set()  # the lowest: what this machine can do
