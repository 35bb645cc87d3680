"""/v1/admin: fault injection (pump, chiller, power cap, dead sensor) behind the admin token."""

from __future__ import annotations

from fastapi import APIRouter

from tokenyard.services.facilities.api.deps import Admin, Monitor, Rack
from tokenyard.services.facilities.api.errors import ApiError
from tokenyard.services.facilities.api.schemas import FaultIn, FaultsOut

router = APIRouter(prefix="/v1/admin/racks", tags=["admin"], dependencies=[Admin])


@router.post("/{rack}/faults")
async def inject_fault(body: FaultIn, monitor: Monitor, rt: Rack) -> FaultsOut:
    if body.kind == "power_cap" and body.power_cap_kw is None:
        raise ApiError(
            400, "a power_cap fault needs power_cap_kw", code="missing_param", param="power_cap_kw"
        )
    faults = monitor.inject(rt.spec.name, body.kind, body.power_cap_kw)
    return FaultsOut(rack=rt.spec.name, faults=faults.active())


@router.delete("/{rack}/faults")
async def clear_faults(monitor: Monitor, rt: Rack) -> FaultsOut:
    monitor.clear(rt.spec.name)
    return FaultsOut(rack=rt.spec.name, faults=[])
