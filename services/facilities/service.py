"""Wiring: settings -> database, NATS, monitor, REST API; one stop event ends them all."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

from tokenyard.bus.nats import Bus
from tokenyard.db import default_url, make_engine, make_sessionmaker, migrate
from tokenyard.facilities.inventory import load_inventory
from tokenyard.http_server import serve_app
from tokenyard.services.facilities.api import create_app
from tokenyard.services.facilities.autoscale import ReplicaAdvisor, advisor_settings
from tokenyard.services.facilities.control import RackControl
from tokenyard.services.facilities.grpc_api import FacilitiesControlServer
from tokenyard.services.facilities.monitor import RackMonitor
from tokenyard.services.facilities.scaler import ExternalScalerServer
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.facilities.store import FacilitiesStore

log = logging.getLogger(__name__)


async def serve(settings: FacilitiesSettings, stop: asyncio.Event | None = None) -> None:
    """Run the facilities service until `stop` is set (or forever)."""
    stop = stop or asyncio.Event()
    inventory = load_inventory(settings.inventory_path)
    url = settings.db_url or default_url(settings.data_dir, "facilities.db")
    await asyncio.to_thread(migrate, url)
    engine = make_engine(url)
    async with AsyncExitStack() as stack:
        stack.callback(engine.dispose)
        store = FacilitiesStore(make_sessionmaker(engine))
        await asyncio.to_thread(store.sync_inventory, inventory)
        bus = await Bus.connect(settings.nats_url, name="facilities")
        stack.push_async_callback(bus.close)
        monitor = RackMonitor(inventory, store, bus, settings)
        await monitor.start()

        control = RackControl(monitor)
        advisor = None
        if settings.autoscale_mode != "off":
            policy = advisor_settings(settings, inventory)
            advisor = ReplicaAdvisor(monitor, policy, settings.autoscale_interval_s)
        app = create_app(monitor, store, settings, control, advisor)
        # gRPC first: once the HTTP API answers /health, every way in is up.
        grpc_server = FacilitiesControlServer(control, settings)
        await grpc_server.start()
        stack.push_async_callback(grpc_server.stop)
        if advisor is not None and settings.scaler_port is not None:
            scaler = ExternalScalerServer(advisor, settings.host, settings.scaler_port)
            log.info("KEDA external scaler on %s", await scaler.start())
            stack.push_async_callback(scaler.stop)
        api = await stack.enter_async_context(serve_app(app, settings.host, settings.port))
        log.info(
            "facilities: %d racks, API on %s, control (gRPC) on %s, database %s",
            len(monitor.racks),
            api.url,
            grpc_server.endpoint,
            engine.url.render_as_string(),
        )
        async with asyncio.TaskGroup() as tg:
            tg.create_task(monitor.run(stop))
            if advisor is not None:
                tg.create_task(advisor.run(stop))
