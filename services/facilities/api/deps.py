"""Dependencies of the API routers: the monitor, the store, the control, a rack by name
(the admin token check is every service's: tokenyard.api_deps.Admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from tokenyard.api_errors import ApiError
from tokenyard.services.facilities.control import RackControl
from tokenyard.services.facilities.monitor import RackMonitor, RackRuntime
from tokenyard.services.facilities.store import FacilitiesStore


def _monitor(request: Request) -> RackMonitor:
    return request.app.state.monitor


def _store(request: Request) -> FacilitiesStore:
    return request.app.state.store


def _control(request: Request) -> RackControl:
    return request.app.state.control


Monitor = Annotated[RackMonitor, Depends(_monitor)]
Control = Annotated[RackControl, Depends(_control)]
Store = Annotated[FacilitiesStore, Depends(_store)]


def rack_runtime(rack: str, monitor: Monitor) -> RackRuntime:
    rt = monitor.racks.get(rack)
    if rt is None:
        raise ApiError(404, f"no rack named {rack!r}", code="rack_not_found", param="rack")
    return rt


Rack = Annotated[RackRuntime, Depends(rack_runtime)]
