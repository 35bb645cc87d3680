"""The console's KV tiers: the share of prompt tokens each cache tier served (from the
workers' spans) and the bytes moved to and from the shared tier (from their heartbeats)."""

from __future__ import annotations

import pytest

from tokenyard import tracing
from tokenyard.services.telemetry.collector import Collector
from tokenyard.services.telemetry.settings import TelemetrySettings
from tokenyard.services.telemetry.spans import SpanRow
from tokenyard.v1 import serving_pb2 as pb

MIB = 1 << 20


def span(name: str, worker: str, prompt: int = 0, cached: int = 0, fetched: int = 0) -> SpanRow:
    attrs = {
        tracing.WORKER_ID: worker,
        tracing.GEN_AI_USAGE_INPUT_TOKENS: prompt,
        "tokenyard.cached_tokens": cached,
        "tokenyard.fetched_tokens": fetched,
    }
    return SpanRow("t", "s", None, "worker", name, 0, 1, "ok", attrs)


def beat(worker: str, offloaded: int, fetched: int) -> pb.WorkerHeartbeat:
    return pb.WorkerHeartbeat(
        worker_id=worker,
        role="both",
        heartbeat_interval_ms=60_000,
        kvcache_offload_bytes=offloaded,
        kvcache_fetch_bytes=fetched,
    )


async def test_hit_rates_by_tier_and_bytes_moved():
    collector = Collector(None, TelemetrySettings(), None)  # type: ignore[arg-type]
    assert collector.figures()["kv_tiers"] == {
        "local_hit_rate": None,
        "shared_hit_rate": None,
        "offload_bytes": 0,
        "fetch_bytes": 0,
    }
    # w1: 100 prompt tokens, 80 from a cache, 48 of those fetched from the service;
    # w2: 100 prompt tokens, 20 from its own cache.
    for row in (
        span("kvcache.fetch", "w1", fetched=48),
        span("generate", "w1", prompt=100, cached=80),
        span("prefill", "w2", prompt=100, cached=20),
    ):
        await collector._learn(row)
    await collector.on_heartbeat(beat("w1", 3 * MIB, 1 * MIB), None)  # type: ignore[arg-type]
    await collector.on_heartbeat(beat("w2", 2 * MIB, 0), None)  # type: ignore[arg-type]
    tiers = collector.figures()["kv_tiers"]
    assert tiers["local_hit_rate"] == pytest.approx((32 + 20) / 200)
    assert tiers["shared_hit_rate"] == pytest.approx(48 / 200)
    assert (tiers["offload_bytes"], tiers["fetch_bytes"]) == (5 * MIB, 1 * MIB)
    fleet, _ = collector.sample()  # the SQL sample keeps its own columns only
    assert fleet.live_workers == 2
