"""The gateway's /metrics re-exposes the workers' `tokenyard:*` series, labelled by worker:
real ops servers on local ports, one of them hung (it accepts and never answers), which
costs one bounded timeout and shows as `tokenyard_gateway_worker_scrape_up 0`."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from gateway_fakes import MODEL, FakeBackend, fake_state
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from tokenyard.http_server import ops_server
from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.fleet_metrics import FleetMetrics, ops_targets
from tokenyard.v1 import serving_pb2 as pb

LABELS = ("worker", "role", "model")
# Generous for a loaded host: the healthy workers must answer within it.
SCRAPE_TIMEOUT_S = 3.0
# Unbounded, the hung worker would hold a scrape for ever; bounded, it costs one timeout.
HUNG_SCRAPE_LIMIT_S = 10 * SCRAPE_TIMEOUT_S


def worker_registry(worker_id: str, running: int, tokens: int) -> CollectorRegistry:
    """A worker's series as services/worker/metrics.py names them, plus a process series the
    gateway must leave out."""
    r = CollectorRegistry()
    Gauge("tokenyard:num_requests_running", "running", LABELS, registry=r).labels(
        worker_id, "decode", MODEL
    ).set(running)
    Counter("tokenyard:generation_tokens", "generated", LABELS, registry=r).labels(
        worker_id, "decode", MODEL
    ).inc(tokens)
    Histogram("tokenyard:e2e_request_latency_seconds", "e2e", LABELS, registry=r).labels(
        worker_id, "decode", MODEL
    ).observe(0.3)
    Gauge("process_open_fds", "fds", registry=r).set(7)
    return r


@pytest.fixture
async def hung_port() -> AsyncIterator[int]:
    """A port that accepts connections and never answers them."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


def samples(text: str, name: str) -> dict[str, float]:
    """worker -> value of the samples called `name`."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["worker"]] = s.value
    return out


def beat(worker_id: str, ops_endpoint: str) -> pb.WorkerHeartbeat:
    return pb.WorkerHeartbeat(
        worker_id=worker_id, role="decode", model=MODEL, ops_endpoint=ops_endpoint
    )


async def test_the_gateway_metrics_carry_every_live_workers_series(hung_port):
    backend = FakeBackend()
    state = fake_state(backend)
    app = create_app(state.settings, state)
    app.state.gateway = state  # what its lifespan does (ASGITransport runs no lifespan)
    state.metrics.fleet.timeout_s = SCRAPE_TIMEOUT_S
    async with (
        ops_server("127.0.0.1", 0, registry=worker_registry("d1", 3, 40)) as d1,
        ops_server("127.0.0.1", 0, registry=worker_registry("d2", 1, 2)) as d2,
    ):
        now = time.monotonic()
        backend.fleet.on_heartbeat(beat("d1", f"127.0.0.1:{d1.port}"), now)
        backend.fleet.on_heartbeat(beat("d2", f"127.0.0.1:{d2.port}"), now)
        backend.fleet.on_heartbeat(beat("hung", f"127.0.0.1:{hung_port}"), now)
        backend.fleet.on_heartbeat(beat("no-ops", ""), now)  # an older worker: nothing to scrape
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            resp = await asyncio.wait_for(client.get("/metrics"), HUNG_SCRAPE_LIMIT_S)
    assert resp.status_code == 200
    text = resp.text
    assert samples(text, "tokenyard:num_requests_running") == {"d1": 3.0, "d2": 1.0}
    assert samples(text, "tokenyard:generation_tokens_total") == {"d1": 40.0, "d2": 2.0}
    assert samples(text, "tokenyard:e2e_request_latency_seconds_count") == {"d1": 1.0, "d2": 1.0}
    assert "process_open_fds" not in text  # only the fleet's tokenyard:* series come through
    assert samples(text, "tokenyard_gateway_worker_scrape_up") == {
        "d1": 1.0,
        "d2": 1.0,
        "hung": 0.0,
    }
    assert "# TYPE tokenyard:generation_tokens_total counter" in text
    assert "tokenyard_gateway_requests_total" in text  # the gateway's own series stay


async def test_a_worker_that_stops_beating_leaves_the_metrics():
    backend = FakeBackend()
    backend.fleet.on_heartbeat(beat("d1", "127.0.0.1:9"), time.monotonic() - 3600)
    assert ops_targets(backend.fleet, time.monotonic()) == {}
    backend.fleet.on_heartbeat(beat("d2", "10.0.0.7:9100"), time.monotonic())
    assert ops_targets(backend.fleet, time.monotonic()) == {"d2": "http://10.0.0.7:9100/metrics"}


async def test_a_refresh_with_no_targets_empties_the_last_one():
    fleet = FleetMetrics(timeout_s=SCRAPE_TIMEOUT_S)
    async with ops_server("127.0.0.1", 0, registry=worker_registry("d1", 1, 1)) as d1:
        await fleet.refresh({"d1": f"{d1.url}/metrics"})
    assert any(f.name == "tokenyard:num_requests_running" for f in fleet.collect())
    await asyncio.wait_for(fleet.refresh({}), 1)
    assert [f.name for f in fleet.collect()] == ["tokenyard_gateway_worker_scrape_up"]
