"""Prometheus metrics of the gateway, in a registry of its own (one per app, so tests can make
many); the registry also carries the fleet's `tokenyard:*` series (fleet_metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenyard.services.gateway.fleet_metrics import FleetMetrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenyard_gateway_requests",
            "Finished requests by route and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "tokenyard_gateway_ttft_seconds",
            "Time to first token",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tokenyard_gateway_e2e_seconds",
            "Request latency, arrival to last token",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("tokenyard_gateway_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter(
            "tokenyard_gateway_completion_tokens", "Generated tokens", registry=r
        )
        self.cached_tokens = Counter(
            "tokenyard_gateway_cached_prompt_tokens", "Prompt tokens served from cache", registry=r
        )
        self.in_flight = Gauge(
            "tokenyard_gateway_requests_in_flight", "Requests being served", registry=r
        )
        self.cancelled = Counter(
            "tokenyard_gateway_cancelled", "Requests cancelled by client disconnect", registry=r
        )
        self.fleet = FleetMetrics()  # refreshed by GET /metrics before it renders
        r.register(self.fleet)
