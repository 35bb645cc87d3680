"""The MoE load-balance metrics: the counter per (layer, expert), fed by the engine's
cumulative counts; with expert parallelism, the per-rank imbalance gauge per (layer, window)
and the rebalances counter."""

from __future__ import annotations

from prometheus_client import REGISTRY

from tokenyard.engine.outputs import EngineStats, ExpertBalanceStats
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


def _imbalance(worker: str, layer: int, window: str) -> float | None:
    labels = {"worker": worker, "role": "both", "model": "m", "layer": str(layer)}
    return REGISTRY.get_sample_value(
        "tokenyard:moe_rank_load_imbalance", {**labels, "window": window}
    )


def _rebalances(worker: str) -> float | None:
    labels = {"worker": worker, "role": "both", "model": "m"}
    return REGISTRY.get_sample_value("tokenyard:moe_expert_rebalances_total", labels)


def test_rank_imbalance_becomes_gauges_and_rebalances_a_counter():
    metrics = WorkerMetrics("ep-w", "both", "m")
    stats = EngineStats(1, 0, 10, 10, 0, 0, 0)
    stats.expert_balance = ExpertBalanceStats([1.5, 1.25], [], 0)  # none yet
    metrics.on_stats(stats)
    assert (_imbalance("ep-w", 0, "current"), _imbalance("ep-w", 1, "current")) == (1.5, 1.25)
    assert _imbalance("ep-w", 0, "before_rebalance") is None
    assert _rebalances("ep-w") == 0
    stats.expert_balance = ExpertBalanceStats([1.0, 1.1], [1.75, 1.5], 2)
    metrics.on_stats(stats)
    assert (_imbalance("ep-w", 0, "current"), _imbalance("ep-w", 1, "current")) == (1.0, 1.1)
    assert _imbalance("ep-w", 0, "before_rebalance") == 1.75
    assert _imbalance("ep-w", 1, "before_rebalance") == 1.5
    assert _rebalances("ep-w") == 2
    stats.expert_balance = ExpertBalanceStats([1.0, 1.0], [1.2, 1.1], 3)  # cumulative count
    metrics.on_stats(stats)
    assert _rebalances("ep-w") == 3
