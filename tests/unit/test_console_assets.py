"""The console's pages name only assets that exist, and the package data ships every one of
them (a wheel without uPlot would serve a console with no charts)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "services/telemetry/console"
PACKAGE = "tokenyard.services.telemetry.console"


def shipped_patterns() -> list[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = data["package-data"]
    return [*package_data.get("*", []), *package_data.get(PACKAGE, [])]


def shipped(path: str, pattern: str) -> bool:
    """setuptools' package-data glob: `*` stays within one folder."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", "[^/]*"), path) is not None


def test_every_asset_a_page_names_exists_and_is_shipped():
    patterns = shipped_patterns()
    for page in ("index.html", "planner.html"):
        for asset in re.findall(r'(?:src|href)="/static/([^"]+)"', (CONSOLE / page).read_text()):
            assert (CONSOLE / asset).is_file(), f"{page} names a missing /static/{asset}"
            assert any(shipped(asset, p) for p in patterns), f"{asset} is not package data"


def test_the_vendored_chart_library_comes_with_its_licence():
    vendor = CONSOLE / "vendor"
    assert {p.name for p in vendor.iterdir()} == {
        "uPlot.iife.min.js",
        "uPlot.min.css",
        "uPlot.LICENSE",
    }
    assert "MIT License" in (vendor / "uPlot.LICENSE").read_text()
    assert (
        (vendor / "uPlot.iife.min.js")
        .read_text()
        .startswith("/*! https://github.com/leeoniya/uPlot")
    )
