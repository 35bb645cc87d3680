"""Wiring: settings -> database, NATS, collector, HTTP (API, console, /metrics); one stop
event ends them all."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from tokenyard.bus.nats import Bus
from tokenyard.db import default_url, make_engine, make_sessionmaker, migrate
from tokenyard.facilities.inventory import Inventory, load_inventory
from tokenyard.http_server import serve_app
from tokenyard.services.telemetry.api import create_app
from tokenyard.services.telemetry.collector import Collector
from tokenyard.services.telemetry.settings import TelemetrySettings
from tokenyard.services.telemetry.store import TelemetryStore

log = logging.getLogger(__name__)


async def serve(settings: TelemetrySettings, stop: asyncio.Event) -> None:
    """Run the telemetry service until `stop` is set."""
    inventory: Inventory | None = (
        load_inventory(settings.inventory_path) if settings.inventory_path else None
    )
    url = settings.db_url or default_url(settings.data_dir, "telemetry.db")
    await asyncio.to_thread(migrate, url)
    engine = make_engine(url)
    async with AsyncExitStack() as stack:
        stack.callback(engine.dispose)
        store = TelemetryStore(make_sessionmaker(engine))
        bus = await Bus.connect(settings.nats_url, name="telemetry")
        stack.push_async_callback(bus.close)
        collector = Collector(store, settings, inventory)
        await collector.start(bus)
        app = create_app(collector, store, bus, settings)
        api = await stack.enter_async_context(serve_app(app, settings.host, settings.port))
        log.info("telemetry: console on %s/, database %s", api.url, engine.url.render_as_string())
        await collector.run(stop)
