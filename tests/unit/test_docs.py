"""docs/architecture.md's module map names every module there is, and only those."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("shared", "services", "kernels")


def _has_code(path: Path) -> bool:
    """An __init__.py with more than a docstring and `from __future__` imports."""
    for node in ast.parse(path.read_text()).body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
        if not (docstring or future):
            return True
    return False


def modules() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.suffix not in (".py", ".cpp") or "v1" in path.parts:
                continue
            if path.name == "__init__.py" and not _has_code(path):
                continue  # the folder's heading in the map says what the package is
            found.add(path.relative_to(ROOT).as_posix())
    return found


def mapped() -> set[str]:
    pattern = re.compile(r"^- `((?:shared|services|kernels)/[^`*]+)`:", re.MULTILINE)
    return set(pattern.findall(ARCHITECTURE.read_text()))


def test_every_module_has_a_line_in_the_module_map():
    assert sorted(modules() - mapped()) == []


def test_the_module_map_names_no_module_that_is_gone():
    assert sorted(mapped() - modules()) == []
