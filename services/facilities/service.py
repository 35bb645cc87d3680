"""Wiring: settings -> database, NATS, monitor, REST API; one stop event ends them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from contextlib import AsyncExitStack

import uvicorn

from tokenyard.bus.nats import Bus
from tokenyard.db import default_url, make_engine, make_sessionmaker, migrate
from tokenyard.facilities.inventory import load_inventory
from tokenyard.services.facilities.api import create_app
from tokenyard.services.facilities.monitor import RackMonitor
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.facilities.store import FacilitiesStore

log = logging.getLogger(__name__)


class _ApiServer(uvicorn.Server):
    # NOTE: the service owns the signals (one stop event for NATS, the monitor and the API);
    # uvicorn's own handlers would swallow them.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


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

        app = create_app(monitor, store, settings)
        sock = _bind(settings.host, settings.port)
        stack.callback(sock.close)
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        server = _ApiServer(config)
        host, port = sock.getsockname()[:2]
        log.info(
            "facilities: %d racks, API on http://%s:%d, database %s",
            len(monitor.racks),
            host,
            port,
            engine.url.render_as_string(),
        )
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(monitor.run(stop))
            tasks.create_task(server.serve(sockets=[sock]))
            await stop.wait()
            server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    """Bind before serving, so port 0 (tests) resolves to a real port the caller can read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock
