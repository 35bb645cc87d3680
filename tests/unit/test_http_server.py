"""The shared ops HTTP server: /health, /ready from the service's callable, /metrics."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry, Counter

from tokenyard.bus.embedded import free_port
from tokenyard.http_server import ReadyFlag, ops_server


async def test_health_ready_and_metrics_on_a_free_port():
    registry = CollectorRegistry()
    jobs = Counter("tokenyard:test_jobs", "jobs", ["role"], registry=registry)
    jobs.labels(role="prefill").inc(3)
    ready = ReadyFlag("loading the model")
    async with ops_server("127.0.0.1", 0, ready=ready, registry=registry) as ops:
        assert ops.port != 0
        async with httpx.AsyncClient(base_url=ops.url) as client:
            assert (await client.get("/health")).status_code == 200
            not_ready = await client.get("/ready")
            assert not_ready.status_code == 503
            assert not_ready.json() == {"ready": False, "reason": "loading the model"}
            ready.set(None)
            assert (await client.get("/ready")).json() == {"ready": True, "reason": None}
            metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'tokenyard:test_jobs_total{role="prefill"} 3.0' in metrics.text


async def test_the_port_is_closed_after_the_block():
    async with ops_server("127.0.0.1", 0) as ops:
        url = ops.url
    async with httpx.AsyncClient() as client:
        try:
            await client.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            return
    raise AssertionError("the ops server still answers after its block ended")


async def test_an_async_readiness_check_is_awaited():
    reasons = ["its JetStream consumer is missing", None]

    async def check() -> str | None:
        return reasons.pop(0)

    async with (
        ops_server("127.0.0.1", 0, ready=check) as ops,
        httpx.AsyncClient(base_url=ops.url) as client,
    ):
        first = await client.get("/ready")
        second = await client.get("/ready")
    assert first.status_code == 503
    assert first.json() == {"ready": False, "reason": "its JetStream consumer is missing"}
    assert second.status_code == 200 and second.json() == {"ready": True, "reason": None}


def test_free_port_comes_from_below_the_ephemeral_range_and_binds() -> None:
    """A port from free_port() is one no bind to 0 or outgoing connection can take before
    the service binds it: below the kernel's ephemeral range, and free."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    for port in ports:
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
