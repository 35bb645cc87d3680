"""/v1/inventory: the site, coolant loops, racks, nodes and worker ids, as loaded from YAML."""

from __future__ import annotations

from fastapi import APIRouter

from tokenyard.facilities.inventory import Inventory
from tokenyard.services.facilities.api.deps import Monitor

router = APIRouter(prefix="/v1/inventory", tags=["inventory"])


@router.get("")
async def get_inventory(monitor: Monitor) -> Inventory:
    return monitor.inventory
