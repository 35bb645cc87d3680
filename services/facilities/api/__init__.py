"""The facilities REST API: one router per resource over the monitor and the store."""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, ProcessCollector

from tokenyard.http_server import ops_router
from tokenyard.services.facilities.api import (
    admin,
    autoscale,
    errors,
    events,
    health,
    inventory,
    racks,
)
from tokenyard.services.facilities.autoscale import ReplicaAdvisor
from tokenyard.services.facilities.control import RackControl
from tokenyard.services.facilities.metrics import RackCollector
from tokenyard.services.facilities.monitor import RackMonitor
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.facilities.store import FacilitiesStore


def create_app(
    monitor: RackMonitor,
    store: FacilitiesStore,
    settings: FacilitiesSettings,
    control: RackControl | None = None,
    advisor: ReplicaAdvisor | None = None,
) -> FastAPI:
    app = FastAPI(title="Tokenyard facilities", version="1")
    app.state.monitor = monitor
    app.state.control = control or RackControl(monitor)
    app.state.store = store
    app.state.settings = settings
    app.state.advisor = advisor
    errors.install(app)
    for module in (health, racks, events, inventory, admin, autoscale):
        app.include_router(module.router)
    # /health above says more (racks, NATS); /ready and /metrics are the shared ones.
    app.include_router(
        ops_router(lambda: _not_ready(monitor), metrics_registry(monitor), health=False)
    )
    return app


def metrics_registry(monitor: RackMonitor) -> CollectorRegistry:
    """One registry per app (tests run several): the racks, and this process's own."""
    registry = CollectorRegistry()
    registry.register(RackCollector(monitor))
    ProcessCollector(registry=registry)
    return registry


def _not_ready(monitor: RackMonitor) -> str | None:
    return None if monitor.bus.nc.is_connected else "not connected to NATS"
