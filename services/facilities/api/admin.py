"""/v1/admin: fault injection (pump, chiller, power cap, dead sensor) and an operator's
drain, behind the admin token: a thin adapter over RackControl, which the gRPC control API
(FacilitiesControl) calls too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter

from tokenyard.api_deps import Admin
from tokenyard.api_errors import ApiError
from tokenyard.facilities.faults import FaultIn
from tokenyard.services.facilities.api.deps import Control, Monitor
from tokenyard.services.facilities.api.racks import rack_out
from tokenyard.services.facilities.api.schemas import DrainIn, FaultsOut, RackOut
from tokenyard.services.facilities.control import ControlError

router = APIRouter(prefix="/v1/admin/racks", tags=["admin"], dependencies=[Admin])


@contextmanager
def answers() -> Iterator[None]:
    """RackControl's refusals as the API's errors."""
    try:
        yield
    except ControlError as error:
        status = 404 if error.kind == "not_found" else 400
        raise ApiError(status, error.message, code=error.code, param=error.param) from error


@router.post("/{rack}/faults")
async def inject_fault(rack: str, body: FaultIn, control: Control) -> FaultsOut:
    with answers():
        rt = await control.inject(rack, body.kind, body.power_cap_kw)
    return FaultsOut(rack=rt.spec.name, faults=rt.faults.active())


@router.delete("/{rack}/faults")
async def clear_faults(rack: str, control: Control) -> FaultsOut:
    with answers():
        rt = await control.clear(rack)
    return FaultsOut(rack=rt.spec.name, faults=[])


@router.post("/{rack}/drain")
async def drain_rack(rack: str, body: DrainIn, control: Control, monitor: Monitor) -> RackOut:
    """Drain the rack whatever its readings say, until undrained."""
    with answers():
        rt = await control.drain(rack, body.reason)
    return rack_out(monitor, rt)


@router.delete("/{rack}/drain")
async def undrain_rack(rack: str, control: Control, monitor: Monitor) -> RackOut:
    """Lift an operator's drain: the readings decide the rack's state again."""
    with answers():
        rt = await control.undrain(rack)
    return rack_out(monitor, rt)
