"""Dependencies of the API routers: the monitor, the store, the admin token check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from tokenyard.services.facilities.api.errors import ApiError
from tokenyard.services.facilities.control import AdminRefusal, RackControl, check_admin
from tokenyard.services.facilities.monitor import RackMonitor, RackRuntime
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.facilities.store import FacilitiesStore


def _monitor(request: Request) -> RackMonitor:
    return request.app.state.monitor


def _store(request: Request) -> FacilitiesStore:
    return request.app.state.store


def _settings(request: Request) -> FacilitiesSettings:
    return request.app.state.settings


def _control(request: Request) -> RackControl:
    return request.app.state.control


Monitor = Annotated[RackMonitor, Depends(_monitor)]
Control = Annotated[RackControl, Depends(_control)]
Store = Annotated[FacilitiesStore, Depends(_store)]
Settings = Annotated[FacilitiesSettings, Depends(_settings)]


def rack_runtime(rack: str, monitor: Monitor) -> RackRuntime:
    rt = monitor.racks.get(rack)
    if rt is None:
        raise ApiError(404, f"no rack named {rack!r}", code="rack_not_found", param="rack")
    return rt


Rack = Annotated[RackRuntime, Depends(rack_runtime)]


def require_admin(
    settings: Settings,
    authorization: Annotated[str | None, Header()] = None,
    x_admin_token: Annotated[str | None, Header()] = None,
) -> None:
    """`Authorization: Bearer <token>` or `X-Admin-Token: <token>`; 401 when absent, 403 when wrong."""
    given = x_admin_token
    if authorization and authorization.lower().startswith("bearer "):
        given = authorization[7:].strip()
    try:
        check_admin(settings.admin_token, given)
    except AdminRefusal as refusal:
        status = 401 if refusal.kind == "missing" else 403
        code = {"missing": "missing_admin_token", "wrong": "invalid_admin_token"}
        raise ApiError(
            status, refusal.message, code=code.get(refusal.kind, "admin_disabled")
        ) from refusal


Admin = Depends(require_admin)
