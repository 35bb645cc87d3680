"""The engine contract: LLMEngine and FakeEngine both satisfy tokenyard.engine.contract.Engine
(checked by mypy over a package view, since the folders are not named like the packages),
and the fake answers with the engine's own output types."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenyard.engine.outputs import EngineStats, ExportedSequence, RequestOutput
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.services.worker.fake_engine import FakeEngine

ROOT = Path(__file__).resolve().parents[2]

# Third-party packages are skipped (read as Any) to keep this to seconds; every
# tokenyard module is followed, so the engine's and the fake's real signatures are compared.
MYPY_INI = """\
[mypy]
python_version = 3.11
ignore_missing_imports = True
follow_imports = skip
[mypy-tokenyard.*]
follow_imports = silent
"""

CONFORMS = """\
from tokenyard.engine.contract import Engine
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.kv.engine_port import KVEngine
from tokenyard.services.worker.fake_engine import FakeEngine


def real(e: LLMEngine) -> Engine:
    return e


def fake(e: FakeEngine) -> Engine:
    return e


def kv_side(e: Engine) -> KVEngine:
    return e
"""

# Proves the check sees real types: were the imports read as Any, these would pass too.
DRIFTS = """\
from tokenyard.engine.contract import Engine
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.outputs import EngineStats


class Drifted:
    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0, 0, 0)


def not_an_int(e: LLMEngine) -> int:
    return e


def drifted(e: Drifted) -> Engine:
    return e
"""


def run_mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import package_view
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    view = package_view.build(tmp_path / "view")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    (tmp_path / "check.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental", "check.py"],
        cwd=tmp_path,
        env={"MYPYPATH": str(view), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_engine_and_fake_satisfy_the_protocol(tmp_path):
    result = run_mypy(tmp_path, CONFORMS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues found in 1 source file" in result.stdout


def test_mypy_catches_a_drifted_engine(tmp_path):
    result = run_mypy(tmp_path, DRIFTS)
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'got "LLMEngine", expected "int"' in result.stdout
    assert 'got "Drifted", expected "Engine"' in result.stdout


def test_fake_engine_answers_with_the_engine_types():
    engine = FakeEngine(step_s=0)
    engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=2), prefill_only=True)
    (out,) = engine.step()
    assert type(out) is RequestOutput
    assert engine.last_step_tokens == 1  # the step timing's x: one decode row
    assert out.finish_reason == "prefilled" and out.num_cached_tokens == 0
    exported = engine.export_sequence("r")
    assert type(exported) is ExportedSequence
    assert exported.request_id == "r" and exported.prompt_token_ids == [3, 4, 5]
    stats = engine.stats()
    assert type(stats) is EngineStats
    assert stats.num_preemptions == 0 and stats.num_blocks - stats.num_free_blocks == 1


def test_fake_engine_prefix_reservation_returns_its_blocks():
    engine = FakeEngine(num_blocks=4, block_size=4, step_s=0)
    blocks = engine.reserve_prefix("p", list(range(8)))
    assert len(blocks) == 2 and engine.stats().num_free_blocks == 2
    assert not engine.has_unfinished()  # never scheduled
    engine.commit_prefix("p", kv_ok=True)
    assert engine.stats().num_free_blocks == 4
    assert engine.cached_block_ids([1, 2]) == []
    with pytest.raises(KeyError):
        engine.commit_prefix("p", kv_ok=True)
