"""The worker's control API (WorkerControl over gRPC): drain, undrain, status.

A drained worker stays up: it fetches no new prefill job, refuses hand-offs, and its
heartbeats say ``draining`` so routers place nothing here; what already runs finishes.
It reports DRAINED once nothing runs and no prefilled blocks wait for a pull, and an
operator can then stop it (or undrain it). The NATS drain (``ty.drain.<worker>``, the ops
console's button) takes the same path, then stops the worker.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc

from tokenyard.grpc_security import GrpcSecurity, add_port, server_interceptors
from tokenyard.net import host_endpoint
from tokenyard.services.worker.base import WorkerBase
from tokenyard.v1 import control_pb2 as cpb
from tokenyard.v1 import control_pb2_grpc

log = logging.getLogger(__name__)

MAX_WAIT_S = 600.0
_POLL_S = 0.05


def drain(worker: WorkerBase, reason: str) -> None:
    """Take no new work from now on (idempotent; a second call keeps the first reason)."""
    if worker.accepting.is_set():
        log.warning("worker %s draining: %s", worker.worker_id, reason or "no reason")
        worker.drain_reason = reason
        worker.accepting.clear()


def undrain(worker: WorkerBase) -> None:
    if not worker.accepting.is_set():
        log.warning("worker %s takes work again", worker.worker_id)
        worker.drain_reason = ""
        worker.accepting.set()


def busy(worker: WorkerBase) -> bool:
    """Requests running here, jobs being worked on, or prefilled blocks awaiting a pull."""
    return worker.streams.busy() or bool(worker.kv.num_held)


async def wait_drained(worker: WorkerBase, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while busy(worker) and time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
    return not busy(worker)


async def status(worker: WorkerBase) -> cpb.WorkerStatus:
    stats = await worker.loop.stats()
    if worker.accepting.is_set():
        state = cpb.WorkerStatus.SERVING
    else:
        state = cpb.WorkerStatus.DRAINING if busy(worker) else cpb.WorkerStatus.DRAINED
    total = stats.num_blocks
    return cpb.WorkerStatus(
        worker_id=worker.worker_id,
        role=worker.settings.role,
        model=worker.model_id,
        state=state,
        drain_reason=worker.drain_reason,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_requests=len(worker.streams.running),
        num_blocks=total,
        num_free_blocks=stats.num_free_blocks,
        kv_used=1.0 - stats.num_free_blocks / total if total else 0.0,
        kv_endpoint=worker.kv.endpoint,
    )


class WorkerControlHandler(control_pb2_grpc.WorkerControlServicer):
    def __init__(self, worker: WorkerBase) -> None:
        self.w = worker

    async def Drain(
        self, request: cpb.WorkerDrainRequest, context: grpc.aio.ServicerContext
    ) -> cpb.WorkerStatus:
        if not (math.isfinite(request.wait_s) and 0 <= request.wait_s <= MAX_WAIT_S):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"wait_s must be between 0 and {MAX_WAIT_S:.0f} seconds, not {request.wait_s}",
            )
        drain(self.w, request.reason)
        if request.wait_s:
            await wait_drained(self.w, request.wait_s)
        return await status(self.w)

    async def Undrain(
        self, request: cpb.WorkerUndrainRequest, context: grpc.aio.ServicerContext
    ) -> cpb.WorkerStatus:
        undrain(self.w)
        return await status(self.w)

    async def Status(
        self, request: cpb.WorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> cpb.WorkerStatus:
        return await status(self.w)


class ControlServer:
    """The worker's WorkerControl gRPC server (the operator's identity only), with TLS when
    configured."""

    def __init__(self, worker: WorkerBase, security: GrpcSecurity | None = None) -> None:
        self.worker = worker
        self.security = security or GrpcSecurity()
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Serve; returns the endpoint to dial, which the worker's heartbeats also carry."""
        s = self.worker.settings
        self._server = grpc.aio.server(interceptors=server_interceptors(self.security))
        control_pb2_grpc.add_WorkerControlServicer_to_server(
            WorkerControlHandler(self.worker), self._server
        )
        port = add_port(self._server, host_endpoint(s.host, s.control_port), self.security)
        if port == 0:
            raise OSError(f"worker control cannot bind {s.host}:{s.control_port}")
        await self._server.start()
        endpoint = host_endpoint(s.advertised_host, port)
        self.worker.presence.control_endpoint = endpoint  # the heartbeats carry it
        log.info("worker %s control on %s", self.worker.worker_id, endpoint)
        return endpoint

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
