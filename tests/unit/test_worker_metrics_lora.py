"""The per-adapter LoRA series a worker's /metrics exports, fed by the engine's stats."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest

from tokenyard.engine.outputs import EngineStats
from tokenyard.services.worker.metrics import WorkerMetrics

LABELS = {"worker": "lora-w", "role": "both", "model": "m"}


def _running(lora: str) -> float | None:
    return REGISTRY.get_sample_value("tokenyard:lora_requests_running", LABELS | {"lora": lora})


def test_running_per_adapter_and_swaps_are_exported():
    metrics = WorkerMetrics("lora-w", "both", "m")
    metrics.on_stats(EngineStats(3, 0, 10, 10, 0, 0, 0, loras={"sql": 2, "poet": 1}, lora_swaps=2))
    assert (_running("sql"), _running("poet")) == (2, 1)
    assert REGISTRY.get_sample_value("tokenyard:lora_swaps_total", LABELS) == 2
    text = generate_latest().decode()
    series = 'tokenyard:lora_requests_running{lora="sql",model="m",role="both",worker="lora-w"}'
    assert f"{series} 2.0" in text  # what a scrape of /metrics reads
    # poet unloaded: its series goes; swaps are cumulative, only the increase is added
    metrics.on_stats(EngineStats(2, 0, 10, 10, 0, 0, 0, loras={"sql": 2}, lora_swaps=3))
    assert _running("poet") is None
    assert REGISTRY.get_sample_value("tokenyard:lora_swaps_total", LABELS) == 3
