"""Operator actions on racks, one code path for the REST admin API and the gRPC control API
(FacilitiesControl): list, inject and clear faults, drain and undrain.

Both adapters map `ControlError` and `AdminRefusal` (tokenyard.api_deps) to their own answers (a 404/400 or
NOT_FOUND/INVALID_ARGUMENT; 401/403 or UNAUTHENTICATED/PERMISSION_DENIED).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tokenyard.facilities.faults import FAULT_KINDS
from tokenyard.services.facilities.monitor import RackMonitor, RackRuntime

MAX_REASON_CHARS = 500


@dataclass
class ControlError(Exception):
    kind: Literal["not_found", "invalid"]
    message: str
    code: str
    param: str | None = None


class RackControl:
    def __init__(self, monitor: RackMonitor) -> None:
        self.monitor = monitor

    def rack(self, name: str) -> RackRuntime:
        rt = self.monitor.racks.get(name)
        if rt is None:
            raise ControlError("not_found", f"no rack named {name!r}", "rack_not_found", "rack")
        return rt

    def racks(self) -> list[RackRuntime]:
        return list(self.monitor.racks.values())

    async def inject(self, name: str, kind: str, power_cap_kw: float | None = None) -> RackRuntime:
        rt = self.rack(name)
        if kind not in FAULT_KINDS:
            raise ControlError(
                "invalid", f"unknown fault {kind!r}; one of {FAULT_KINDS}", "invalid_fault", "kind"
            )
        if kind == "power_cap" and not (
            power_cap_kw is not None and math.isfinite(power_cap_kw) and power_cap_kw > 0
        ):
            raise ControlError(
                "invalid",
                "a power_cap fault needs a positive power_cap_kw",
                "missing_param",
                "power_cap_kw",
            )
        self.monitor.inject(rt.spec.name, kind, power_cap_kw)
        return rt

    async def clear(self, name: str) -> RackRuntime:
        rt = self.rack(name)
        self.monitor.clear(rt.spec.name)
        return rt

    async def drain(self, name: str, reason: str) -> RackRuntime:
        rt = self.rack(name)
        if len(reason) > MAX_REASON_CHARS:
            raise ControlError(
                "invalid",
                f"reason is over {MAX_REASON_CHARS} characters",
                "invalid_reason",
                "reason",
            )
        await self.monitor.drain(rt.spec.name, reason)
        return rt

    async def undrain(self, name: str) -> RackRuntime:
        rt = self.rack(name)
        await self.monitor.undrain(rt.spec.name)
        return rt
