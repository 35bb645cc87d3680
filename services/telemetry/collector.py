"""The telemetry handler: heartbeats, KV events, facilities readings and states, and spans
in from NATS; the live fleet view, request records and samples out (SQL and snapshots)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokenyard import tracing
from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.bus.senders import subscribe_heartbeats, subscribe_kv_events
from tokenyard.db.telemetry import FleetSample, RackSample
from tokenyard.facilities.inventory import Inventory
from tokenyard.fleet import FleetView, WorkerView
from tokenyard.services.telemetry.fleet import PrefixCounts, fleet_tree
from tokenyard.services.telemetry.settings import TelemetrySettings
from tokenyard.services.telemetry.spans import SpanRow, request_fields, rows
from tokenyard.services.telemetry.stats import Finished, Window
from tokenyard.services.telemetry.store import TelemetryStore, now_utc
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import FacilityReading, RackState

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 600.0
MAX_PENDING_PATHS = 10_000  # router placements waiting for their request's root span


class Collector:
    def __init__(
        self, store: TelemetryStore, settings: TelemetrySettings, inventory: Inventory | None
    ) -> None:
        self.store = store
        self.settings = settings
        self.inventory = inventory
        self.fleet = FleetView(missed_heartbeats=settings.missed_heartbeats)
        self.states: dict[str, RackState] = {}
        self.readings: dict[str, FacilityReading] = {}
        self.prefix: dict[str, PrefixCounts] = {}
        self.kv_blocks: dict[str, int] = {}  # worker -> blocks it announced stored, net
        self.window = Window(settings.window_s)
        self.paths: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.spans_seen = 0
        self.requests_seen = 0

    async def start(self, bus: Bus) -> None:
        await subscribe_heartbeats(bus, self.on_heartbeat)
        await subscribe_kv_events(bus, self.on_kv_event)
        await bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, self.on_rack_state)
        await bus.subscribe(subjects.FACILITIES_READINGS_ALL, FacilityReading, self.on_reading)
        await bus.subscribe(subjects.TELEMETRY_SPANS_ALL, ExportTraceServiceRequest, self.on_spans)

    # --- inputs ---------------------------------------------------------------------------

    async def on_heartbeat(self, hb: pb.WorkerHeartbeat, _msg: Msg) -> None:
        self.fleet.on_heartbeat(hb, time.monotonic())

    async def on_kv_event(self, event: pb.KVEvent, _msg: Msg) -> None:
        n = self.kv_blocks.get(event.worker_id, 0)
        if event.kind == pb.KVEvent.STORED:
            n += len(event.block_hashes)
        elif event.kind == pb.KVEvent.REMOVED:
            n -= len(event.block_hashes)
        elif event.kind == pb.KVEvent.CLEARED:
            n = 0
        self.kv_blocks[event.worker_id] = max(0, n)

    async def on_rack_state(self, state: RackState, _msg: Msg) -> None:
        self.states[state.rack] = state

    async def on_reading(self, reading: FacilityReading, _msg: Msg) -> None:
        self.readings[reading.rack] = reading

    async def on_spans(self, export: ExportTraceServiceRequest, _msg: Msg) -> None:
        batch = rows(export)
        self.spans_seen += len(batch)
        await asyncio.to_thread(self.store.add_spans, batch)
        for row in batch:
            await self._learn(row)

    async def _learn(self, row: SpanRow) -> None:
        """What a span says about its request, its worker's prefix hits, the live window."""
        if row.name in ("prefill", "generate"):
            counts = self.prefix.setdefault(
                str(row.attributes.get(tracing.WORKER_ID)), PrefixCounts()
            )
            counts.prompt_tokens += int(row.attributes.get(tracing.GEN_AI_USAGE_INPUT_TOKENS) or 0)
            counts.cached_tokens += int(row.attributes.get("tokenyard.cached_tokens") or 0)
        elif row.name == "kvcache.fetch":
            counts = self.prefix.setdefault(
                str(row.attributes.get(tracing.WORKER_ID)), PrefixCounts()
            )
            counts.fetched_tokens += int(row.attributes.get("tokenyard.fetched_tokens") or 0)
        rid = row.request_id
        fields = request_fields(row)
        if rid is None or not fields:
            return
        if not row.is_request_root:
            self.paths[rid] = fields
            while len(self.paths) > MAX_PENDING_PATHS:
                self.paths.popitem(last=False)
            # The root usually comes last; an update only applies once the record exists.
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._update_if_known, rid, fields)
            return
        fields.update(self.paths.pop(rid, {}))
        await asyncio.to_thread(self.store.upsert_request, rid, **fields)
        self.requests_seen += 1
        self.window.add(
            Finished(
                at=row.end_unix_ns / 1e9,
                ttft_s=fields["ttft_s"],
                duration_s=row.duration_s,
                prompt_tokens=int(fields["prompt_tokens"] or 0),
                cached_tokens=int(fields["cached_tokens"] or 0),
                output_tokens=int(fields["output_tokens"] or 0),
                energy_joules=fields["energy_joules"],
            )
        )

    def _update_if_known(self, rid: str, fields: dict[str, Any]) -> None:
        if self.store.request(rid) is not None:
            self.store.upsert_request(rid, **fields)

    # --- outputs --------------------------------------------------------------------------

    def racks(self) -> list[dict]:
        return fleet_tree(
            self.fleet, time.monotonic(), self.inventory, self.states, self.readings, self.prefix
        )

    def figures(self) -> dict[str, Any]:
        now = time.monotonic()
        live = self.fleet.live(now)
        blocks = sum(w.heartbeat.num_blocks for w in live)
        free = sum(w.heartbeat.num_free_blocks for w in live)
        return {
            "live_workers": len(live),
            "roles": self.fleet.roles(now),
            "tokens_per_s": sum(w.heartbeat.tokens_per_s for w in live),
            "num_running": sum(w.heartbeat.num_running for w in live),
            "num_waiting": sum(w.heartbeat.num_waiting for w in live),
            "kv_usage": 1.0 - free / blocks if blocks else 0.0,
            **self.window.figures(time.time()),
            "kv_tiers": self.kv_tiers(live),
        }

    def kv_tiers(self, live: list[WorkerView]) -> dict[str, float | None]:
        """Since this service started: the share of prompt tokens each cache tier served,
        and the KV bytes the live workers moved to and from the shared KV-cache service
        since they started."""
        counts = self.prefix.values()
        prompt = sum(c.prompt_tokens for c in counts)
        fetched = sum(c.fetched_tokens for c in counts)
        cached = sum(c.cached_tokens for c in counts)
        return {
            "local_hit_rate": max(0, cached - fetched) / prompt if prompt else None,
            "shared_hit_rate": min(fetched, cached) / prompt if prompt else None,
            "offload_bytes": sum(w.heartbeat.kvcache_offload_bytes for w in live),
            "fetch_bytes": sum(w.heartbeat.kvcache_fetch_bytes for w in live),
        }

    def sample(self) -> tuple[FleetSample, list[RackSample]]:
        f, ts = self.figures(), now_utc()
        fleet = FleetSample(
            ts=ts,
            **{k: v for k, v in f.items() if k not in ("roles", "kv_tiers")},
        )
        racks = [
            RackSample(
                ts=ts,
                rack=r["name"],
                state=r["state"],
                power_kw=r["power_kw"],
                supply_c=r["supply_c"],
                return_c=r["return_c"],
                flow_lpm=r["flow_lpm"],
            )
            for r in self.racks()
            if r["power_kw"] is not None
        ]
        return fleet, racks

    async def run(self, stop: asyncio.Event) -> None:
        """Sample the fleet into SQL every sample_every_s; prune by retention."""
        last_prune = 0.0
        while not stop.is_set():
            try:
                fleet, racks = self.sample()
                await asyncio.to_thread(self.store.add_fleet_sample, fleet, racks)
                if time.monotonic() - last_prune > PRUNE_EVERY_S:
                    last_prune = time.monotonic()
                    retention = timedelta(hours=self.settings.retention_h)
                    await asyncio.to_thread(self.store.prune, retention)
            except Exception:
                # NOTE: a failed sample (database hiccup) must not end the collector.
                log.exception("telemetry sample failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.sample_every_s)
