"""The KV-cache service's Prometheus metrics, read from the store at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenyard.kv.store.tiered import TieredStore


class StoreCollector(Collector):
    """Hits, misses, bytes, blocks and evictions of a TieredStore, per tier."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        tiers = self.store.tiers
        hits = CounterMetricFamily(
            "tokenyard:kvcache_hits",
            "Block look-ups served, by the tier that held it",
            labels=["tier"],
        )
        evictions = CounterMetricFamily(
            "tokenyard:kvcache_evictions", "Blocks pushed out of a tier", labels=["tier"]
        )
        stored = GaugeMetricFamily("tokenyard:kvcache_bytes", "Bytes held", labels=["tier"])
        blocks = GaugeMetricFamily("tokenyard:kvcache_blocks", "Blocks held", labels=["tier"])
        capacity = GaugeMetricFamily(
            "tokenyard:kvcache_capacity_bytes", "A tier's byte budget", labels=["tier"]
        )
        for tier in tiers:
            hits.add_metric([tier.name], tier.counters.hits)
            evictions.add_metric([tier.name], tier.counters.evictions)
            stored.add_metric([tier.name], tier.index.nbytes)
            blocks.add_metric([tier.name], len(tier.index.sizes))
            capacity.add_metric([tier.name], tier.index.capacity_bytes)
        yield from (hits, evictions, stored, blocks, capacity)
        yield CounterMetricFamily(
            "tokenyard:kvcache_misses", "Block look-ups no tier held", value=self.store.misses
        )
        yield CounterMetricFamily(
            "tokenyard:kvcache_refused_writes",
            "Blocks written under a hash already held with other bytes (the held ones stay)",
            value=self.store.refused,
        )
        yield CounterMetricFamily(
            "tokenyard:kvcache_dropped",
            "Blocks evicted from the last tier",
            value=self.store.dropped,
        )
