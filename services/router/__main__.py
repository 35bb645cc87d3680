"""`python -m tokenyard.services.router`: wiring only (settings, NATS, handlers, shutdown)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from tokenyard.bus import auth, subjects
from tokenyard.bus.auth import redact
from tokenyard.bus.nats import Bus
from tokenyard.bus.orphans import OrphanedJobs
from tokenyard.bus.senders import subscribe_heartbeats, subscribe_kv_events
from tokenyard.http_server import ops_server
from tokenyard.lifecycle import run_until_signalled, settings_or_exit
from tokenyard.routing.cost import CostConfig
from tokenyard.routing.policy import PolicyConfig
from tokenyard.services.router.handler import RouterHandler
from tokenyard.services.router.settings import RouterSettings
from tokenyard.services.router.shared_tier import SharedTier
from tokenyard.span_bus import spans_to_bus
from tokenyard.tracing import setup_tracing
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger("tokenyard.router")

READY_PING_TIMEOUT_S = 2


def policy_config(settings: RouterSettings) -> PolicyConfig:
    return PolicyConfig(
        disaggregation=settings.disaggregation,
        costs=CostConfig(handoff_fixed_ms=settings.handoff_fixed_ms),
        missed_heartbeats=settings.missed_heartbeats,
        queue_per_worker=settings.queue_per_worker,
        overlap_weight=settings.overlap_weight,
        kv_weight=settings.kv_weight,
        shared_hit_value=settings.shared_hit_value,
        placement=settings.placement,
        lora_load_busy=settings.lora_load_busy,
    )


async def serve(settings: RouterSettings, stop: asyncio.Event) -> None:
    async with AsyncExitStack() as stack:
        bus = await Bus.connect(settings.nats_url, name="router")
        stack.push_async_callback(bus.close)
        await stack.enter_async_context(spans_to_bus(bus, "router"))
        shared = None
        if settings.kvcache_endpoint:
            shared = SharedTier(settings.kvcache_endpoint, settings.kvcache_timeout_s)
            stack.push_async_callback(shared.close)
        handler = RouterHandler(bus, policy_config(settings), shared=shared)
        stack.push_async_callback(handler.close)
        await handler.fleet.racks.start(bus)  # ty.facilities.state.*: drained / derated racks
        await subscribe_heartbeats(bus, handler.on_heartbeat)
        await subscribe_kv_events(bus, handler.on_kv_event)
        # A queue group lets several routers share the load; each builds its own view.
        await bus.subscribe(
            subjects.ROUTER_ROUTE, pb.RouteRequest, handler.on_route, queue="router"
        )
        orphans = OrphanedJobs(
            bus,
            subjects.PREFILL_STREAM,
            auth.PREFILL_CONSUMER_PREFIX,
            subjects.prefill_worker_jobs,
            pb.PrefillJob,
            place=handler.place_again,
            alive=handler.worker_alive,
            announce=handler.announce_move,
            stopping=stop,
            grace_s=settings.orphans_after_s,
        )
        moving = asyncio.create_task(orphans.run(), name="orphaned jobs")
        stack.push_async_callback(lambda: moving)  # it ends once `stop` is set
        ops = await stack.enter_async_context(
            ops_server(settings.ops_host, settings.ops_port, ready=lambda: _not_ready(bus))
        )
        log.info("router ready on %s; ops on %s", redact(settings.nats_url), ops.url)
        await stop.wait()
        log.info("router stopping")


async def _not_ready(bus: Bus) -> str | None:
    """Ready while NATS answers a round trip: the route requests reach us through it."""
    if not bus.nc.is_connected:
        return "not connected to NATS"
    try:
        await bus.nc.flush(timeout=READY_PING_TIMEOUT_S)
    except Exception as exc:  # a connection that looks up but carries nothing
        return f"NATS does not answer ({type(exc).__name__})"
    return None


def main() -> None:
    settings = settings_or_exit(RouterSettings, "router")
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s router %(levelname)s %(message)s"
    )
    setup_tracing("router")

    run_until_signalled(lambda stop: serve(settings, stop))


if __name__ == "__main__":
    main()
