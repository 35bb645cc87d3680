"""benchmarks/result_path.py: a run's results go outside the repo unless --out says where."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "result_path.py"


@pytest.fixture(scope="module")
def result_path():
    spec = importlib.util.spec_from_file_location("result_path_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_is_a_new_file_in_the_results_folder(result_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENYARD_BENCH_RESULTS", str(tmp_path / "runs"))
    out = result_path.out_path(None, "peers")
    assert out.parent == tmp_path / "runs"
    assert out.parent.is_dir()
    assert out.name.startswith(f"peers-{socket.gethostname()}-")
    assert out.suffix == ".json"


def test_without_the_variable_results_go_to_the_user_cache(result_path, tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENYARD_BENCH_RESULTS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert result_path.results_dir() == tmp_path / ".cache/tokenyard/bench-results"


def test_out_is_taken_as_given(result_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENYARD_BENCH_RESULTS", str(tmp_path / "runs"))
    given = tmp_path / "mine" / "engine.json"
    assert result_path.out_path(given, "engine") == given
    assert given.parent.is_dir()
    assert not (tmp_path / "runs").exists()
