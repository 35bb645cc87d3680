"""The facilities service's gRPC control API (FacilitiesControl), over the same RackControl
as the REST admin API.

Reading the racks needs the operator's gRPC token (or the admin token) when either is
configured; every change needs the admin token, as the REST admin API does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from tokenyard.api_deps import AdminRefusal, admin_setting, check_admin
from tokenyard.grpc_security import (
    CALLERS,
    GrpcSecurity,
    RejectUndecodable,
    add_port,
    identify,
    presented_token,
    token_matches,
)
from tokenyard.services.facilities.control import (
    ControlError,
    RackControl,
)
from tokenyard.services.facilities.monitor import RackMonitor, RackRuntime
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.v1 import control_pb2 as cpb
from tokenyard.v1 import control_pb2_grpc

SERVICE = cpb.DESCRIPTOR.services_by_name["FacilitiesControl"].full_name
_REFUSAL_CODES = {
    "missing": grpc.StatusCode.UNAUTHENTICATED,
    "wrong": grpc.StatusCode.UNAUTHENTICATED,
    "disabled": grpc.StatusCode.PERMISSION_DENIED,
}
_ERROR_CODES = {"not_found": grpc.StatusCode.NOT_FOUND, "invalid": grpc.StatusCode.INVALID_ARGUMENT}


def rack_info(monitor: RackMonitor, rt: RackRuntime) -> cpb.RackInfo:
    return cpb.RackInfo(
        state=monitor.state_message(rt, monitor.clock()),
        faults=rt.faults.active(),
        power_cap_kw=rt.limits.power_cap_kw,
        operator_drain=bool(rt.operator_drain),
    )


class FacilitiesControlHandler(control_pb2_grpc.FacilitiesControlServicer):
    def __init__(
        self, control: RackControl, settings: FacilitiesSettings, security: GrpcSecurity
    ) -> None:
        self.control = control
        self.settings = settings
        self.peers = security.peer_digests()

    async def _read_allowed(self, context: grpc.aio.ServicerContext) -> None:
        admin = self.settings.admin_token
        if not self.peers and not admin:
            return  # nothing configured: open, as the other internal servers are
        given = presented_token(context.invocation_metadata())
        if admin and token_matches(given, admin):
            return
        identity = identify(self.peers, given)
        if identity is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        if identity not in CALLERS[SERVICE]:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{identity!r} may not call {SERVICE}"
            )

    async def _admin(self, context: grpc.aio.ServicerContext) -> None:
        try:
            given = presented_token(context.invocation_metadata())
            check_admin(self.settings.admin_token, given, admin_setting(self.settings))
        except AdminRefusal as refusal:
            await context.abort(_REFUSAL_CODES[refusal.kind], refusal.message)

    async def _change(
        self, context: grpc.aio.ServicerContext, action: Callable[[], Awaitable[RackRuntime]]
    ) -> cpb.RackInfo:
        """An admin-only change through RackControl, its refusals as gRPC statuses."""
        await self._admin(context)
        try:
            rt = await action()
        except ControlError as error:
            await context.abort(_ERROR_CODES[error.kind], error.message)
            raise  # abort raised already; this keeps `rt` bound for the reader and mypy
        return rack_info(self.control.monitor, rt)

    async def ListRacks(
        self, request: cpb.ListRacksRequest, context: grpc.aio.ServicerContext
    ) -> cpb.ListRacksReply:
        await self._read_allowed(context)
        monitor = self.control.monitor
        return cpb.ListRacksReply(racks=[rack_info(monitor, rt) for rt in self.control.racks()])

    async def SetFault(
        self, request: cpb.SetFaultRequest, context: grpc.aio.ServicerContext
    ) -> cpb.RackInfo:
        cap = request.power_cap_kw if request.kind == "power_cap" else None
        return await self._change(
            context, lambda: self.control.inject(request.rack, request.kind, cap)
        )

    async def ClearFaults(
        self, request: cpb.RackRequest, context: grpc.aio.ServicerContext
    ) -> cpb.RackInfo:
        return await self._change(context, lambda: self.control.clear(request.rack))

    async def DrainRack(
        self, request: cpb.DrainRackRequest, context: grpc.aio.ServicerContext
    ) -> cpb.RackInfo:
        return await self._change(context, lambda: self.control.drain(request.rack, request.reason))

    async def UndrainRack(
        self, request: cpb.RackRequest, context: grpc.aio.ServicerContext
    ) -> cpb.RackInfo:
        return await self._change(context, lambda: self.control.undrain(request.rack))


class FacilitiesControlServer:
    def __init__(
        self,
        control: RackControl,
        settings: FacilitiesSettings,
        security: GrpcSecurity | None = None,
    ) -> None:
        self.control, self.settings = control, settings
        self.security = security or GrpcSecurity()
        self.endpoint = ""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        s = self.settings
        # Tokens are checked per method (reads: the stack's; changes: the admin token).
        self._server = grpc.aio.server(interceptors=[RejectUndecodable()])
        control_pb2_grpc.add_FacilitiesControlServicer_to_server(
            FacilitiesControlHandler(self.control, s, self.security), self._server
        )
        port = add_port(self._server, f"{s.host}:{s.grpc_port}", self.security)
        if port == 0:
            raise OSError(f"facilities control cannot bind {s.host}:{s.grpc_port}")
        await self._server.start()
        self.endpoint = f"{s.host}:{port}"
        return self.endpoint

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
