"""The sender side of a KV hand-off: a gRPC server inside each prefill worker.

The worker calls :meth:`KVTransferServer.offer` once a request's prompt is prefilled; the
blocks then stay held until the receiver releases them, aborts, or stays silent for
``hold_timeout_s``. Each of those ends the hold exactly once with ``on_release(request_id)``
(the worker frees the engine's blocks there).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
import torch
from opentelemetry import trace

from tokenyard.grpc_security import GRPC_OPTIONS, MAX_MESSAGE_BYTES, add_port, server_interceptors
from tokenyard.kv.layout import KVLayout, layout_from_proto, layout_to_proto
from tokenyard.kv.transfer import mooncake
from tokenyard.kv.transfer.common import (
    block_crc32,
    check_pool,
    host_id,
    pool_bytes,
    process_id,
)
from tokenyard.kv.transfer.holds import HoldTable
from tokenyard.kv.transfer.negotiate import TRANSPORTS, ordered
from tokenyard.kv.transfer.settings import KVTransferSettings
from tokenyard.kv.transfer.shm import shared_pool_name
from tokenyard.kv.transfer.wire import encode_chunk
from tokenyard.net import advertise_address, host_endpoint
from tokenyard.tracing import REQUEST_ID, grpc_context, tracer
from tokenyard.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)
_tracer = tracer("tokenyard.kv.transfer")

MIN_CHUNK_BYTES = 64 << 10

SERVICE = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
READ_BLOCKS = f"/{SERVICE}/ReadBlocks"

# Servers running in this process by endpoint: the "inproc" transport copies straight
# from their pools. Entries live exactly from start() to stop().
LOCAL_SERVERS: dict[str, KVTransferServer] = {}


@dataclass(frozen=True)
class FaultInjection:
    """Test-only misbehaviour of the gRPC data path."""

    chunk_delay_s: float = 0.0  # sleep before every chunk (slow sender, to be killed)
    corrupt_chunk: int | None = None  # flip a byte of this chunk after its checksum


class KVTransferServer:
    def __init__(
        self,
        pool: torch.Tensor,
        layout: KVLayout,
        *,
        on_release: Callable[[str], None],
        host: str | None = None,
        advertise_host: str = "",
        port: int = 0,
        hold_timeout_s: float | None = None,
        allowed: Sequence[str] | None = None,
        settings: KVTransferSettings | None = None,
        shm_name: str | None = None,
        faults: FaultInjection | None = None,
    ):
        check_pool(pool, layout)
        s = settings or KVTransferSettings()
        self.pool, self.layout = pool, layout
        self.settings = s
        self.allowed = ordered(allowed if allowed is not None else s.allowed)
        self.holds = HoldTable(hold_timeout_s if hold_timeout_s is not None else s.hold_timeout_s)
        self._on_release = on_release
        self._host, self._port = host or s.host, port
        # NOTE: the endpoint peers dial is never the bind address itself when that is
        # 0.0.0.0: a decode worker on another host would dial its own machine.
        self.advertised = advertise_address(self._host, advertise_host or s.advertise_host)
        self._shm_name = shm_name if shm_name is not None else shared_pool_name(pool)
        self._faults = faults or FaultInjection()
        self._mooncake: mooncake.MooncakeEngine | None = None
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.endpoint = ""

    async def start(self) -> str:
        """Serve; returns the endpoint ("host:port") receivers pull from."""
        if "mooncake" in self.allowed:
            self._mooncake = mooncake.process_engine(
                self.advertised, self.settings.mooncake_protocol, self.settings.mooncake_device
            )
            if self._mooncake is not None:
                self._mooncake.register(self.pool)
        self._server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=server_interceptors())
        self._server.add_generic_rpc_handlers((_handlers(_Servicer(self)),))
        port = add_port(self._server, host_endpoint(self._host, self._port))
        await self._server.start()
        self.endpoint = host_endpoint(self.advertised, port)
        LOCAL_SERVERS[self.endpoint] = self
        self._sweeper = asyncio.create_task(self._sweep(), name=f"kv-hold-sweep {self.endpoint}")
        log.info("KV transfer server at %s, transports %s", self.endpoint, self.allowed)
        return self.endpoint

    def offer(self, request_id: str, block_ids: list[int]) -> None:
        """Hold these blocks for a receiver to pull (thread-safe)."""
        bad = [b for b in block_ids if not 0 <= b < self.pool.shape[0]]
        if bad:
            raise ValueError(f"block ids {bad[:8]} outside the pool of {self.pool.shape[0]}")
        self.holds.offer(request_id, block_ids)

    def end_hold(self, request_id: str, why: str) -> bool:
        """End a hold (once): the blocks go back to the engine through on_release."""
        if not self.holds.end(request_id):
            return False
        log.debug("KV hold of %s ended: %s", request_id, why)
        self._release(request_id)
        return True

    async def stop(self, grace: float = 1.0) -> None:
        LOCAL_SERVERS.pop(self.endpoint, None)
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            await self._server.stop(grace)
        if self._mooncake is not None:
            self._mooncake.unregister(self.pool)

    async def _sweep(self) -> None:
        period = min(1.0, max(0.05, self.holds.hold_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            for request_id in self.holds.expired():
                log.warning("KV hold of %s expired unreleased; freeing its blocks", request_id)
                self._release(request_id)

    def _release(self, request_id: str) -> None:
        try:
            self._on_release(request_id)
        except Exception:  # the engine's problem, but it must not kill the server
            log.exception("on_release(%s) failed", request_id)

    def describe(self, req: kv_pb2.DescribeRequest) -> kv_pb2.DescribeReply:
        reply = kv_pb2.DescribeReply(
            layout=layout_to_proto(self.layout),
            transports=self.allowed,
            host_id=host_id(),
            process_id=process_id(),
            shm_name=self._shm_name or "",
            pool_nbytes=self.pool.nbytes,
            hold_expires_in_s=self.holds.expires_in(req.request_id),
        )
        if self._mooncake is not None:
            reply.mooncake_endpoint = self._mooncake.endpoint
            reply.pool_address = self.pool.data_ptr()
        if req.want_checksums:
            reply.block_crc32.extend(block_crc32(self.pool, list(req.src_block_ids)))
        return reply

    async def chunks(self, req: kv_pb2.ReadBlocksRequest) -> AsyncIterator[bytes]:
        """The requested blocks' bytes, concatenated in request order, as serialized
        BlockChunk messages (see wire.py)."""
        flat = pool_bytes(self.pool).numpy()
        nb = self.layout.block_nbytes
        # NOTE: at least one block (or MIN_CHUNK_BYTES) per message: a forged chunk_bytes of 1
        # would otherwise turn one read into millions of messages.
        floor = min(nb, MIN_CHUNK_BYTES)
        step = max(floor, min(req.chunk_bytes or self.settings.chunk_bytes, MAX_MESSAGE_BYTES // 2))
        ids = list(req.src_block_ids)
        total = len(ids) * nb
        for n, offset in enumerate(range(0, total, step)):
            if self._faults.chunk_delay_s:
                await asyncio.sleep(self._faults.chunk_delay_s)
            why = self.holds.check(req.request_id, ids)
            if why is not None:  # expired or aborted under us: the bytes may be reused
                raise LookupError(why)
            pieces = []
            pos, end = offset, min(offset + step, total)
            while pos < end:
                block, within = divmod(pos, nb)
                take = min(nb - within, end - pos)
                start = ids[block] * nb + within
                pieces.append(flat[start : start + take].data)
                pos += take
            message = encode_chunk(offset, pieces)
            if self._faults.corrupt_chunk == n:
                message = message[:-1] + bytes([message[-1] ^ 0xFF])
            yield message


class _Servicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, server: KVTransferServer):
        self.s = server

    async def Describe(self, request, context):
        with _tracer.start_as_current_span(
            "kv_transfer.describe",
            context=grpc_context(context),
            kind=trace.SpanKind.SERVER,
            attributes={REQUEST_ID: request.request_id, "kv.blocks": len(request.src_block_ids)},
        ):
            return await self._describe(request, context)

    async def _describe(self, request, context):
        why = self.s.layout.mismatch(layout_from_proto(request.layout))
        if why is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        why = self.s.holds.check(request.request_id, list(request.src_block_ids))
        if why is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, why)
        return self.s.describe(request)

    async def ReadBlocks(self, request, context):
        ids = list(request.src_block_ids)
        if len(set(ids)) != len(ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "src_block_ids repeat a block")
        why = self.s.holds.check(request.request_id, ids)
        if why is not None:
            await context.abort(grpc.StatusCode.NOT_FOUND, why)
        try:
            async for chunk in self.s.chunks(request):
                yield chunk
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    async def Release(self, request, context):
        return kv_pb2.ReleaseReply(was_held=self.s.end_hold(request.request_id, "released"))

    async def Abort(self, request, context):
        held = self.s.end_hold(request.request_id, f"aborted by receiver: {request.reason}")
        return kv_pb2.AbortReply(was_held=held)


def _handlers(servicer: _Servicer) -> grpc.GenericRpcHandler:
    """The KVTransfer service, as generated, except that ReadBlocks yields BlockChunk
    messages already serialized (wire.py)."""
    unary = grpc.unary_unary_rpc_method_handler
    methods = {
        "Describe": unary(
            servicer.Describe,
            request_deserializer=kv_pb2.DescribeRequest.FromString,
            response_serializer=kv_pb2.DescribeReply.SerializeToString,
        ),
        "ReadBlocks": grpc.unary_stream_rpc_method_handler(
            servicer.ReadBlocks, request_deserializer=kv_pb2.ReadBlocksRequest.FromString
        ),
        "Release": unary(
            servicer.Release,
            request_deserializer=kv_pb2.ReleaseRequest.FromString,
            response_serializer=kv_pb2.ReleaseReply.SerializeToString,
        ),
        "Abort": unary(
            servicer.Abort,
            request_deserializer=kv_pb2.AbortRequest.FromString,
            response_serializer=kv_pb2.AbortReply.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)


__all__ = ["TRANSPORTS", "FaultInjection", "KVTransferServer", "LOCAL_SERVERS"]
