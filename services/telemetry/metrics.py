"""The fleet's aggregate Prometheus metrics, read from the collector at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenyard.services.telemetry.collector import Collector as TelemetryCollector

# figure -> (metric, help)
FIGURES = {
    "tokens_per_s": (
        "tokenyard:fleet_generation_tokens_per_second",
        "Tokens generated per second, all workers",
    ),
    "num_running": ("tokenyard:fleet_num_requests_running", "Sequences running, all workers"),
    "num_waiting": ("tokenyard:fleet_num_requests_waiting", "Sequences waiting, all workers"),
    "kv_usage": (
        "tokenyard:fleet_kv_cache_usage_perc",
        "KV blocks in use over all live workers, 0 to 1",
    ),
    "requests_per_s": (
        "tokenyard:fleet_requests_per_second",
        "Requests finished per second (window)",
    ),
    "ttft_p50_s": ("tokenyard:fleet_time_to_first_token_p50_seconds", "TTFT median (window)"),
    "ttft_p99_s": ("tokenyard:fleet_time_to_first_token_p99_seconds", "TTFT p99 (window)"),
    "itl_p50_s": ("tokenyard:fleet_inter_token_latency_p50_seconds", "ITL median (window)"),
    "itl_p99_s": ("tokenyard:fleet_inter_token_latency_p99_seconds", "ITL p99 (window)"),
    "prefix_hit_rate": (
        "tokenyard:fleet_prefix_cache_hit_rate",
        "Cached share of prompt tokens (window)",
    ),
    "joules_per_token": (
        "tokenyard:fleet_energy_joules_per_output_token",
        "Energy per output token (window; usage.energy_joules, modelled or measured)",
    ),
}


class FleetCollector(Collector):
    def __init__(self, collector: TelemetryCollector) -> None:
        self.c = collector

    def collect(self) -> Iterator[Metric]:
        figures = self.c.figures()
        for key, (name, help_) in FIGURES.items():
            if figures.get(key) is not None:
                yield GaugeMetricFamily(name, help_, value=figures[key])
        workers = GaugeMetricFamily(
            "tokenyard:fleet_workers", "Workers by role and state", labels=["role", "state"]
        )
        counts: dict[tuple[str, str], int] = {}
        for rack in self.c.racks():
            for node in rack["nodes"]:
                for w in node["workers"]:
                    pair = (str(w["role"]), str(w["state"]))
                    counts[pair] = counts.get(pair, 0) + 1
        for (role, state), n in sorted(counts.items()):
            workers.add_metric([role, state], n)
        yield workers
        yield CounterMetricFamily(
            "tokenyard:telemetry_spans_received", "Spans received", value=self.c.spans_seen
        )
        yield CounterMetricFamily(
            "tokenyard:telemetry_requests_recorded", "Requests recorded", value=self.c.requests_seen
        )
