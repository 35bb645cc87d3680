"""The MoE load-balance counter: per (layer, expert), fed by the engine's cumulative counts."""

from __future__ import annotations

from prometheus_client import REGISTRY

from tokenyard.engine.outputs import EngineStats
from tokenyard.services.worker.metrics import WorkerMetrics


def _value(worker: str, layer: int, expert: int) -> float | None:
    return REGISTRY.get_sample_value(
        "tokenyard:moe_expert_tokens_total",
        {
            "worker": worker,
            "role": "both",
            "model": "m",
            "layer": str(layer),
            "expert": str(expert),
        },
    )


def test_expert_token_counts_become_counters():
    metrics = WorkerMetrics("moe-w", "both", "m")
    stats = EngineStats(1, 0, 10, 10, 0, 0, 0, expert_tokens=[[3, 1], [0, 4]])
    metrics.on_stats(stats)
    assert (_value("moe-w", 0, 0), _value("moe-w", 0, 1), _value("moe-w", 1, 1)) == (3, 1, 4)
    stats.expert_tokens = [[5, 1], [2, 4]]  # cumulative: only the increase is added
    metrics.on_stats(stats)
    assert (_value("moe-w", 0, 0), _value("moe-w", 0, 1), _value("moe-w", 1, 0)) == (5, 1, 2)
    metrics.on_stats(EngineStats(0, 0, 10, 10, 0, 0, 0))  # a dense model reports none
    assert _value("moe-w", 1, 1) == 4
