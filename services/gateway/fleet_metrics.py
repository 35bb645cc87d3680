"""The fleet's `tokenyard:*` series on the gateway's /metrics, so one scrape target shows
every worker.

Each worker serves its vLLM-named series on its own ops server, whose address rides in its
heartbeats (`ops_endpoint`). On every scrape of the gateway, `FleetMetrics.refresh` reads
the live workers' /metrics concurrently, each with a bounded timeout (a hung worker costs
one timeout, a dead one nothing: it is no longer live), and keeps their `tokenyard:*`
families, each sample labelled with its worker. The collector then hands those families to
the registry's text output, beside `tokenyard_gateway_worker_scrape_up{worker}` (1 when the
worker answered, as Prometheus's own `up`).

NOTE: Prometheus itself (infra/) still scrapes every service directly; this is the one URL
for a dashboard or a person with curl.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import httpx
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tokenyard.fleet import FleetView

PREFIX = "tokenyard:"
WORKER_LABEL = "worker"
SCRAPE_TIMEOUT_S = 2.0  # per worker; the scrapes run concurrently


def ops_targets(fleet: FleetView, now: float) -> dict[str, str]:
    """worker id -> its /metrics URL, for the live workers that announce an ops server."""
    return {
        w.worker_id: f"http://{w.heartbeat.ops_endpoint}/metrics"
        for w in fleet.live(now)
        if w.heartbeat.ops_endpoint
    }


def worker_families(text: str, worker_id: str) -> list[Metric]:
    """The `tokenyard:*` families of one worker's /metrics, every sample labelled with the
    worker (its own `worker` label kept where it has one)."""
    out = []
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX):
            continue
        labelled = Metric(family.name, family.documentation, family.type, family.unit)
        labelled.samples = [
            s._replace(labels={WORKER_LABEL: worker_id} | s.labels) for s in family.samples
        ]
        out.append(labelled)
    return out


def merge(per_worker: Iterable[list[Metric]]) -> list[Metric]:
    """One family per name, with the samples of every worker (the first worker's help and type)."""
    merged: dict[str, Metric] = {}
    for families in per_worker:
        for family in families:
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            if into.type == family.type:
                into.samples.extend(family.samples)
    return list(merged.values())


class FleetMetrics(Collector):
    """The last scrape of the fleet, as a prometheus_client collector."""

    def __init__(self, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._families: list[Metric] = []
        self._up: dict[str, bool] = {}

    async def refresh(self, targets: dict[str, str]) -> None:
        """Scrape every target now (concurrently, each bounded by `timeout_s`)."""
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            got = await asyncio.gather(
                *(self._scrape(client, worker, url) for worker, url in targets.items())
            )
        scraped = dict(zip(targets, got, strict=True))
        self._up = {worker: families is not None for worker, families in scraped.items()}
        self._families = merge(families for families in scraped.values() if families is not None)

    async def _scrape(
        self, client: httpx.AsyncClient, worker_id: str, url: str
    ) -> list[Metric] | None:
        """One worker's families, or None when it does not answer in time, or not in the
        text format."""
        try:
            async with asyncio.timeout(self.timeout_s):  # the whole exchange, not per read
                resp = await client.get(url)
            resp.raise_for_status()
            return worker_families(resp.text, worker_id)
        except (TimeoutError, httpx.HTTPError, ValueError):
            return None

    def collect(self) -> Iterator[Metric]:
        yield from self._families
        up = GaugeMetricFamily(
            "tokenyard_gateway_worker_scrape_up",
            "1 when the worker's ops /metrics answered the gateway's last scrape, else 0",
            labels=[WORKER_LABEL],
        )
        for worker, answered in sorted(self._up.items()):
            up.add_metric([worker], 1.0 if answered else 0.0)
        yield up
