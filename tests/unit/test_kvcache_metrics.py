"""The KV-cache service's /metrics read the store's own counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tokenyard.kv.store.tiered import TieredStore
from tokenyard.kv.store.tiers import RamTier
from tokenyard.services.kvcache.metrics import StoreCollector


async def test_hits_misses_and_bytes_by_tier():
    store = TieredStore([RamTier(1 << 20)])
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    await store.put("a", b"x" * 100)
    assert await store.get("a") == b"x" * 100
    assert await store.get("b") is None
    assert await store.get("a") is not None

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("tokenyard:kvcache_hits_total", tier="ram") == 2
    assert value("tokenyard:kvcache_misses_total") == 1
    assert value("tokenyard:kvcache_blocks", tier="ram") == 1
    assert value("tokenyard:kvcache_bytes", tier="ram") >= 100
    assert value("tokenyard:kvcache_capacity_bytes", tier="ram") == 1 << 20
