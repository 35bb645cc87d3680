"""/health: the service is up and connected to NATS."""

from __future__ import annotations

from fastapi import APIRouter

from tokenyard.services.facilities.api.deps import Monitor
from tokenyard.services.facilities.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/health")
async def health(monitor: Monitor) -> Health:
    return Health(status="ok", racks=len(monitor.racks), nats_connected=monitor.bus.nc.is_connected)
