"""The receiver side of a KV hand-off: pull a prefilled request's blocks into our pool.

    decode worker                               prefill worker (KVTransferServer)
    dst = engine.import_sequence(...)
    pull(endpoint, rid, src, dst) --Describe-->  layout check, hold check, how to reach the pool
                                  <-- bytes --   inproc copy | shm copy | Mooncake READ | gRPC stream
                                  --Release-->   on_release(rid): prefill frees its blocks
    engine.commit_import(rid, kv_ok=True)

Any failure: Abort (best effort; the sender's hold timeout covers a lost Abort), raise
KVTransferError, and the caller commits with kv_ok=False so the engine recomputes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from tokenyard.grpc_security import GRPC_OPTIONS, GrpcSecurity, open_channel
from tokenyard.kv.checksum import crc32
from tokenyard.kv.layout import KVLayout, layout_from_proto, layout_to_proto
from tokenyard.kv.transfer import mooncake
from tokenyard.kv.transfer.common import (
    TRANSFER_BYTES,
    TRANSFER_FAILURES,
    TRANSFER_SECONDS,
    KVTransferError,
    TransferResult,
    block_crc32,
    check_pool,
    copy_blocks,
    host_id,
    pool_bytes,
    process_id,
)
from tokenyard.kv.transfer.negotiate import Peer, candidates, ordered
from tokenyard.kv.transfer.server import LOCAL_SERVERS, READ_BLOCKS
from tokenyard.kv.transfer.settings import KVTransferSettings
from tokenyard.kv.transfer.shm import Attached
from tokenyard.kv.transfer.wire import decode_chunk
from tokenyard.net import advertise_address
from tokenyard.tracing import grpc_metadata
from tokenyard.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 1.0

_Channel = tuple[grpc.aio.Channel, kv_pb2_grpc.KVTransferStub, grpc.aio.UnaryStreamMultiCallable]


@dataclass
class _Attempt:
    transport: str = "none"  # the transport being tried, for metrics and errors


class _Unusable(Exception):
    """A transport cannot be set up for this peer; nothing was written, try the next."""


class KVTransferClient:
    def __init__(
        self,
        pool: torch.Tensor,
        layout: KVLayout,
        *,
        allowed: Sequence[str] | None = None,
        timeout_s: float | None = None,
        settings: KVTransferSettings | None = None,
        advertise_host: str = "",
        security: GrpcSecurity | None = None,
    ):
        check_pool(pool, layout)
        s = settings or KVTransferSettings()
        # Our own Mooncake engine's name, should we start one: reachable, as the sender's is.
        self.advertised = advertise_host or advertise_address(s.host, s.advertise_host)
        self.pool, self.layout, self.settings = pool, layout, s
        self.allowed = ordered(allowed if allowed is not None else s.allowed)
        self.timeout_s = timeout_s if timeout_s is not None else s.timeout_s
        # The token and TLS settings every pull presents: TOKENYARD_GRPC_* unless given.
        self.security = security or GrpcSecurity()
        self._channels: dict[str, _Channel] = {}
        self._attached: dict[str, Attached] = {}
        self._mooncake: mooncake.MooncakeEngine | None = None

    async def pull(
        self, endpoint: str, request_id: str, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> TransferResult:
        """Copy the sender's ``src_block_ids`` into ``pool[dst_block_ids]``, then release them."""
        if len(src_block_ids) != len(dst_block_ids):
            raise ValueError("src_block_ids and dst_block_ids differ in length")
        stub = self._stub(endpoint)
        started = time.perf_counter()
        attempt = _Attempt()
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._transfer(
                    attempt, endpoint, stub, request_id, src_block_ids, dst_block_ids
                )
        except Exception as exc:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            TRANSFER_FAILURES.labels(attempt.transport, outcome).inc()
            await self._abort(stub, request_id, f"{outcome}: {exc}")
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(
                f"KV pull of {request_id!r} from {endpoint} via {attempt.transport} failed: "
                f"{_describe_exc(exc)}"
            ) from exc
        transport = attempt.transport
        seconds = time.perf_counter() - started
        nbytes = len(src_block_ids) * self.layout.block_nbytes
        TRANSFER_SECONDS.labels(transport).observe(seconds)
        TRANSFER_BYTES.labels(transport).inc(nbytes)
        log.info(
            "KV pull %s: %d blocks, %.1f MB via %s in %.3f s",
            request_id,
            len(src_block_ids),
            nbytes / 1e6,
            transport,
            seconds,
        )
        return TransferResult(transport=transport, nbytes=nbytes, seconds=seconds)

    async def _transfer(self, attempt, endpoint, stub, request_id, src, dst) -> None:
        """Describe, move the bytes over the first usable transport, Release."""
        desc = await self._describe(stub, request_id, src)
        for attempt.transport in self._candidates(endpoint, desc):
            try:
                await self._move(attempt.transport, endpoint, stub, desc, request_id, src, dst)
                break
            except _Unusable as exc:
                log.info("KV transport %s unusable for %s: %s", attempt.transport, endpoint, exc)
        else:
            raise KVTransferError(f"no transport usable between us and {endpoint}")
        released = await stub.Release(kv_pb2.ReleaseRequest(request_id=request_id))
        if not released.was_held:
            raise KVTransferError(
                f"the sender stopped holding {request_id!r} before we released it"
            )

    async def close(self) -> None:
        for channel, *_ in self._channels.values():
            await channel.close()
        self._channels.clear()
        for attached in self._attached.values():
            attached.close()
        self._attached.clear()
        if self._mooncake is not None:
            self._mooncake.unregister(self.pool)

    async def __aenter__(self) -> KVTransferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- negotiation ----

    async def _describe(self, stub, request_id: str, src: list[int]) -> kv_pb2.DescribeReply:
        req = kv_pb2.DescribeRequest(
            request_id=request_id,
            layout=layout_to_proto(self.layout),
            src_block_ids=src,
            want_checksums=self.settings.verify_memory_transports,
        )
        desc = await stub.Describe(req, metadata=grpc_metadata())
        why = self.layout.mismatch(layout_from_proto(desc.layout))
        if why is not None:  # the server refuses too; this covers an older server
            raise KVTransferError(why)
        return desc

    def _candidates(self, endpoint: str, desc: kv_pb2.DescribeReply) -> list[str]:
        if "mooncake" in self.allowed and desc.mooncake_endpoint and self._mooncake is None:
            s = self.settings
            self._mooncake = mooncake.process_engine(
                self.advertised, s.mooncake_protocol, s.mooncake_device
            )
        me = Peer(
            frozenset(self.allowed),
            host_id(),
            process_id(),
            has_mooncake=self._mooncake is not None,
        )
        them = Peer(
            frozenset(desc.transports),
            desc.host_id,
            desc.process_id,
            has_shm=bool(desc.shm_name),
            has_mooncake=bool(desc.mooncake_endpoint),
        )
        return candidates(me, them, server_in_process=endpoint in LOCAL_SERVERS)

    # ---- transports ----

    async def _move(self, transport, endpoint, stub, desc, request_id, src, dst) -> None:
        if transport == "grpc":
            await self._pull_grpc(endpoint, request_id, src, dst)
            return
        if transport == "inproc":
            server = LOCAL_SERVERS.get(endpoint)
            if server is None:
                raise _Unusable("server no longer registered in this process")
            copy_blocks(server.pool, self.pool, src, dst)
        elif transport == "shm":
            source = self._attach(desc.shm_name, desc.pool_nbytes)
            copy_blocks(source.view(-1, self.layout.block_nbytes), self.pool, src, dst)
        elif transport == "mooncake":
            await self._pull_mooncake(desc, src, dst)
        if desc.block_crc32 and block_crc32(self.pool, dst) != list(desc.block_crc32):
            raise KVTransferError(f"checksum mismatch after {transport} copy of {request_id!r}")

    def _attach(self, name: str, nbytes: int) -> torch.Tensor:
        attached = self._attached.get(name)
        if attached is None:
            try:
                attached = Attached(name, nbytes)
            except (OSError, ValueError) as exc:  # another /dev/shm namespace, or resized
                raise _Unusable(str(exc)) from exc
            self._attached[name] = attached
        assert attached.bytes is not None
        return attached.bytes

    async def _pull_mooncake(self, desc, src, dst) -> None:
        engine = self._mooncake
        if engine is None:
            raise _Unusable("no local Mooncake engine")
        engine.register(self.pool)
        # Blocking native call: run it off the event loop; asyncio.timeout still bounds us
        # (a wedged native read keeps its thread, never the caller).
        await asyncio.to_thread(
            engine.read_blocks,
            desc.mooncake_endpoint,
            desc.pool_address,
            self.pool,
            self.layout.block_nbytes,
            src,
            dst,
        )

    async def _pull_grpc(
        self, endpoint: str, request_id: str, src: list[int], dst: list[int]
    ) -> None:
        nb = self.layout.block_nbytes
        total = len(src) * nb
        flat = pool_bytes(self.pool).numpy()
        request = kv_pb2.ReadBlocksRequest(
            request_id=request_id, src_block_ids=src, chunk_bytes=self.settings.chunk_bytes
        )
        call = self._read_blocks(endpoint)(request)
        try:
            received = 0
            while received < total:
                message = await asyncio.wait_for(call.read(), self.settings.stall_timeout_s)
                if message is grpc.aio.EOF:
                    raise KVTransferError(f"sender ended the stream at byte {received} of {total}")
                offset, crc, data = decode_chunk(message)
                if offset != received:
                    raise KVTransferError(f"chunk at byte {offset}, expected {received}")
                if crc32(data) != crc:
                    raise KVTransferError(f"corrupt KV chunk at byte {received} (crc32 mismatch)")
                _scatter(flat, dst, nb, received, data)
                received += len(data)
        finally:
            call.cancel()

    async def _abort(self, stub, request_id: str, reason: str) -> None:
        try:
            await stub.Abort(
                kv_pb2.AbortRequest(request_id=request_id, reason=reason[:200]),
                timeout=ABORT_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:  # dead sender: its hold timeout frees the blocks
            log.info("KV abort of %s not delivered: %s", request_id, exc.code().name)

    def _stub(self, endpoint: str) -> kv_pb2_grpc.KVTransferStub:
        return self._channel(endpoint)[1]

    def _read_blocks(self, endpoint: str) -> grpc.aio.UnaryStreamMultiCallable:
        return self._channel(endpoint)[2]

    def _channel(self, endpoint: str) -> _Channel:
        if endpoint not in self._channels:
            channel = open_channel(endpoint, GRPC_OPTIONS, self.security)
            # ReadBlocks without a deserializer: messages arrive as bytes for wire.py.
            read_blocks = channel.unary_stream(
                READ_BLOCKS, request_serializer=kv_pb2.ReadBlocksRequest.SerializeToString
            )
            self._channels[endpoint] = (channel, kv_pb2_grpc.KVTransferStub(channel), read_blocks)
        return self._channels[endpoint]


def _scatter(flat: np.ndarray, dst: list[int], nb: int, offset: int, data: memoryview) -> None:
    """Write ``data`` (bytes ``offset..`` of the concatenated blocks) into their destination
    blocks of the pool."""
    view = np.frombuffer(data, dtype=np.uint8)
    pos = 0
    while pos < len(view):
        block, within = divmod(offset + pos, nb)
        take = min(nb - within, len(view) - pos)
        start = dst[block] * nb + within
        flat[start : start + take] = view[pos : pos + take]
        pos += take


def _describe_exc(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"
