"""benchmarks/peers.py's host probe and its place in the report."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(_PATH.parent))  # peers.py takes its memory probe from engine.py
    spec = importlib.util.spec_from_file_location("peers_under_test", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(_PATH.parent))
    sys.modules.pop(spec.name, None)
    sys.modules.pop("engine", None)


def test_host_probe_measures_the_machine(peers) -> None:
    probe = peers.host_probe()
    assert set(probe) == {"read_gb_s", "fp32_matmul_gflop_s"}
    assert probe["read_gb_s"] > 0.1
    assert probe["fp32_matmul_gflop_s"] > 0.1


def test_report_names_the_host_around_each_server(peers) -> None:
    before = {"read_gb_s": 21.3, "fp32_matmul_gflop_s": 230.0}
    after = {"read_gb_s": 13.1, "fp32_matmul_gflop_s": 150.5}
    run = {"output_tok_s": 100.0, "ttft_p50_ms": 70.0, "ok": 8, "failed": 0}
    doc = {
        "workloads": ["chat c=1"],
        "servers": {
            "tokenyard up": {
                "start_s": 7.0,
                "workloads": {"chat c=1": run},
                "host_before": before,
                "host_after": after,
            },
            "vLLM-CPU": {"start_s": 90.0, "workloads": {"chat c=1": run}},
        },
    }
    text = peers.markdown(doc)
    assert (
        "- host around `tokenyard up`: memory read 21.3 -> 13.1 GB/s, "
        "fp32 matmul 230.0 -> 150.5 GFLOP/s" in text
    )
    assert "- host around `vLLM-CPU`: not probed" in text


def _server(tok_s: float, ttft_ms: float) -> dict:
    return {
        "start_s": 1.0,
        "workloads": {"chat c=32": {"output_tok_s": tok_s, "ttft_p50_ms": ttft_ms, "ok": 64}},
    }


def test_rounds_compare_each_round_with_its_own_peer_figures(peers) -> None:
    rounds = [
        {"tokenyard up": _server(600.0, 400.0), "vLLM-CPU": _server(500.0, 500.0)},
        {"tokenyard up": _server(400.0, 600.0), "vLLM-CPU": _server(400.0, 400.0)},
        {"tokenyard up": _server(700.0, 450.0), "vLLM-CPU": _server(500.0, 500.0)},
    ]
    got = peers.ratios(rounds, "vLLM-CPU")
    assert set(got) == {"tokenyard up"}  # the peer is not compared with itself
    c32 = got["tokenyard up"]["chat c=32"]
    assert c32["tok_s"] == [1.2, 1.0, 1.4]
    assert c32["ttft"] == [0.8, 1.5, 0.9]
    assert c32["tok_s_median"] == 1.2
    assert c32["ttft_median"] == 0.9
    doc = {"workloads": ["chat c=32"], "servers": rounds[0], "rounds": rounds, "ratios": got}
    text = peers.markdown(doc)
    assert "- `tokenyard up` against vLLM-CPU, 3 rounds (each, then the median):" in text
    assert (
        "  - chat c=32: tok/s 1.20x / 1.00x / 1.40x (median 1.20x); "
        "TTFT p50 0.80x / 1.50x / 0.90x (median 0.90x)" in text
    )


def test_rounds_skip_a_server_missing_from_a_round(peers) -> None:
    rounds = [
        {"tokenyard up": _server(600.0, 400.0), "vLLM-CPU": _server(500.0, 500.0)},
        {"tokenyard up": _server(400.0, 600.0)},
    ]
    assert peers.ratios(rounds, "vLLM-CPU") == {}
