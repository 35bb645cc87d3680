"""Internal gRPC with a token per identity, over real gRPC servers: each server takes only
the identities that may call it (UNAUTHENTICATED for strangers, PERMISSION_DENIED for a
known identity with no business there), and its handlers know who called."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from tokenyard.grpc_security import (
    OPERATOR,
    GrpcSecurity,
    caller,
    fresh_tokens,
    open_channel,
    peers_text,
    server_interceptors,
)
from tokenyard.kv.hashing import prefix_block_hashes
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.client import KVCacheClient, KVCacheError
from tokenyard.kv.transfer import KVTransferClient, KVTransferError, KVTransferServer
from tokenyard.services.kvcache.server import KVCacheServer, serve
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.v1 import control_pb2, control_pb2_grpc

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
TOKENS = fresh_tokens()
PEERS = peers_text(TOKENS)


def as_(identity: str | None) -> GrpcSecurity:
    """The settings of a caller presenting ``identity``'s token (None: no token)."""
    return GrpcSecurity(token=TOKENS[identity] if identity else "")


@pytest.fixture
async def kvcache() -> AsyncIterator[KVCacheServer]:
    settings = KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0)
    server = await serve(settings, GrpcSecurity(peers=PEERS))
    yield server
    await server.stop()


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_a_caller_without_a_known_token_can_neither_put_nor_read(kvcache, token):
    hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
    pool = torch.randn(LAYOUT.pool_shape(4))
    stranger = KVCacheClient(kvcache.endpoint, security=GrpcSecurity(token=token or ""))
    async with stranger:
        with pytest.raises(KVCacheError, match="UNAUTHENTICATED"):
            await stranger.put_blocks(LAYOUT, hashes, pool, [0, 1])
        with pytest.raises(KVCacheError, match="UNAUTHENTICATED"):
            await stranger.contains(LAYOUT, hashes)
    async with KVCacheClient(kvcache.endpoint, security=as_("decode")) as worker:
        assert (await worker.stats()).hits == 0
        assert await worker.contains(LAYOUT, hashes) == 0  # nothing was planted


async def test_one_pool_writes_and_another_reads(kvcache):
    hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
    src = torch.randn(LAYOUT.pool_shape(4))
    async with KVCacheClient(kvcache.endpoint, security=as_("prefill")) as prefill:
        assert await prefill.put_blocks(LAYOUT, hashes, src, [0, 1]) == 2
    async with KVCacheClient(kvcache.endpoint, security=as_("decode")) as decode:
        dst = torch.zeros(LAYOUT.pool_shape(4))
        assert await decode.get_prefix(LAYOUT, hashes, dst, [2, 3]) == 2
        assert torch.equal(dst[2:], src[:2])


async def test_the_operator_token_cannot_touch_blocks_nor_a_worker_token_clear_them(kvcache):
    hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
    pool = torch.randn(LAYOUT.pool_shape(4))
    async with KVCacheClient(kvcache.endpoint, security=as_(OPERATOR)) as operator:
        with pytest.raises(KVCacheError, match="PERMISSION_DENIED"):
            await operator.put_blocks(LAYOUT, hashes, pool, [0, 1])
        with pytest.raises(KVCacheError, match="PERMISSION_DENIED"):
            await operator.get_prefix(LAYOUT, hashes, pool, [2, 3])
    async with KVCacheClient(kvcache.endpoint, security=as_("prefill")) as worker:
        assert await worker.put_blocks(LAYOUT, hashes, pool, [0, 1]) == 2
    for identity, code in (("prefill", "PERMISSION_DENIED"), (OPERATOR, "OK")):
        channel = open_channel(kvcache.endpoint, [], as_(identity))
        admin = control_pb2_grpc.KVCacheAdminStub(channel)
        try:
            cleared = await admin.Clear(control_pb2.ClearRequest())
            outcome = "OK"
        except grpc.aio.AioRpcError as exc:
            outcome, cleared = exc.code().name, None
        finally:
            await channel.close()
        assert outcome == code
    assert cleared is not None and cleared.blocks == 2  # only the operator's Clear ran


async def test_kv_transfer_serves_the_decoding_pools_only(monkeypatch):
    monkeypatch.setenv("TOKENYARD_GRPC_PEERS", PEERS)  # the sender reads its peers from env
    src = torch.randn(LAYOUT.pool_shape(4))
    server = KVTransferServer(src, LAYOUT, on_release=lambda _rid: None, allowed=["grpc"])
    endpoint = await server.start()
    try:
        for identity in (None, "prefill", OPERATOR):
            server.offer("r1", [1, 2])
            dst = torch.zeros(LAYOUT.pool_shape(4))
            client = KVTransferClient(dst, LAYOUT, allowed=["grpc"], security=as_(identity))
            async with client:
                with pytest.raises(KVTransferError, match="UNAUTHENTICATED|PERMISSION_DENIED"):
                    await client.pull(endpoint, "r1", [1, 2], [0, 3])
            assert torch.count_nonzero(dst) == 0
            server.end_hold("r1", "test")
        for identity in ("decode", "both"):
            server.offer("r2", [1, 2])
            dst = torch.zeros(LAYOUT.pool_shape(4))
            client = KVTransferClient(dst, LAYOUT, allowed=["grpc"], security=as_(identity))
            async with client:
                await client.pull(endpoint, "r2", [1, 2], [0, 3])
            assert torch.equal(dst[[0, 3]], src[[1, 2]])
    finally:
        await server.stop(0)


# --- handlers know who called --------------------------------------------------------------

SERVICE = "tokenyard.v1.KVCache"  # any service the worker identities may call


def _whoami_handlers() -> grpc.GenericRpcHandler:
    """Each kind of call answers with caller(), as the handler saw it."""

    async def unary(request: bytes, context) -> bytes:
        return caller().encode()

    async def unary_stream(request: bytes, context) -> AsyncIterator[bytes]:
        yield caller().encode()

    async def stream_unary(requests, context) -> bytes:
        async for _ in requests:
            pass
        return caller().encode()

    async def stream_stream(requests, context) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield caller().encode()

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "UU": grpc.unary_unary_rpc_method_handler(unary),
            "US": grpc.unary_stream_rpc_method_handler(unary_stream),
            "SU": grpc.stream_unary_rpc_method_handler(stream_unary),
            "SS": grpc.stream_stream_rpc_method_handler(stream_stream),
        },
    )


async def _one_message() -> AsyncIterator[bytes]:
    yield b"x"


async def test_every_kind_of_handler_knows_which_identity_called():
    security = GrpcSecurity(peers=PEERS)
    server = grpc.aio.server(interceptors=server_interceptors(security))
    server.add_generic_rpc_handlers((_whoami_handlers(),))
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        for identity in ("prefill", "decode", "both"):
            channel = open_channel(endpoint, [], as_(identity))
            path = f"/{SERVICE}/"
            heard = [
                await channel.unary_unary(path + "UU")(b"x"),
                *[m async for m in channel.unary_stream(path + "US")(b"x")],
                await channel.stream_unary(path + "SU")(_one_message()),
                *[m async for m in channel.stream_stream(path + "SS")(_one_message())],
            ]
            await channel.close()
            assert heard == [identity.encode()] * 4
        channel = open_channel(endpoint, [], as_(OPERATOR))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary(f"/{SERVICE}/UU")(b"x")
        await channel.close()
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'operator' may not call tokenyard.v1.KVCache" in refused.value.details()
    finally:
        await server.stop(0)


async def test_a_service_missing_from_the_table_is_closed_to_every_identity():
    security = GrpcSecurity(peers=PEERS)
    server = grpc.aio.server(interceptors=server_interceptors(security))
    handler = grpc.method_handlers_generic_handler(
        "tokenyard.v1.Unlisted",
        {"UU": grpc.unary_unary_rpc_method_handler(lambda request, context: b"served")},
    )
    server.add_generic_rpc_handlers((handler,))
    endpoint = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        for identity in TOKENS:
            channel = open_channel(endpoint, [], as_(identity))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary("/tokenyard.v1.Unlisted/UU")(b"x")
            await channel.close()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(0)


async def test_the_kv_cache_service_reads_its_peers_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENYARD_GRPC_PEERS", PEERS)
    monkeypatch.delenv("TOKENYARD_GRPC_TOKEN", raising=False)
    server = await serve(KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0))
    try:
        hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
        async with KVCacheClient(server.endpoint, security=as_(None)) as stranger:
            with pytest.raises(KVCacheError, match="UNAUTHENTICATED"):
                await stranger.contains(LAYOUT, hashes)
        async with KVCacheClient(server.endpoint, security=as_("decode")) as worker:
            assert await worker.contains(LAYOUT, hashes) == 0
    finally:
        await server.stop()
