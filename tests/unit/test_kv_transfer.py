"""KV pulls between two pools in one process, over each transport."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tokenyard.kv.layout import KVLayout
from tokenyard.kv.transfer import (
    FaultInjection,
    KVTransferClient,
    KVTransferError,
    KVTransferServer,
    KVTransferSettings,
    allocate_shared_pool,
    free_shared_pool,
)
from tokenyard.kv.transfer import mooncake as mooncake_mod

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
NUM_BLOCKS = 16
SRC = [3, 4, 5, 9, 1]
DST = [0, 1, 2, 7, 15]


def filled(num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    return torch.randn(LAYOUT.pool_shape(num_blocks))


def assert_landed(src_pool, dst_pool, src=SRC, dst=DST):
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(dst_pool[d], src_pool[s]), f"block {s} -> {d} differs"
    untouched = sorted(set(range(dst_pool.shape[0])) - set(dst))
    assert torch.count_nonzero(dst_pool[untouched]) == 0


class Sender:
    def __init__(self, pool, **kwargs):
        self.released: list[str] = []
        self.server = KVTransferServer(pool, LAYOUT, on_release=self.released.append, **kwargs)

    async def __aenter__(self):
        self.endpoint = await self.server.start()
        return self

    async def __aexit__(self, *exc):
        await self.server.stop(0)


@pytest.mark.parametrize("transport", ["inproc", "grpc"])
async def test_pull_lands_blocks_and_releases(transport):
    src_pool = filled()
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    async with Sender(src_pool, allowed=[transport]) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, LAYOUT, allowed=[transport]) as client:
            result = await client.pull(sender.endpoint, "r1", SRC, DST)
    assert result.transport == transport
    assert result.nbytes == len(SRC) * LAYOUT.block_nbytes
    assert sender.released == ["r1"]
    assert_landed(src_pool, dst_pool)


async def test_grpc_chunks_smaller_than_a_block():
    src_pool = filled()
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    settings = KVTransferSettings(allowed=["grpc"], chunk_bytes=1000)  # block is 768 B
    async with Sender(src_pool, settings=settings) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, LAYOUT, settings=settings) as client:
            await client.pull(sender.endpoint, "r1", SRC, DST)
    assert_landed(src_pool, dst_pool)


async def test_shm_pool_is_mapped_by_the_receiver():
    src_pool, name = allocate_shared_pool(LAYOUT, NUM_BLOCKS)
    src_pool.copy_(filled())
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    settings = KVTransferSettings(allowed=["shm", "grpc"], verify_memory_transports=True)
    try:
        async with Sender(src_pool, settings=settings) as sender:
            sender.server.offer("r1", SRC)
            async with KVTransferClient(dst_pool, LAYOUT, settings=settings) as client:
                result = await client.pull(sender.endpoint, "r1", SRC, DST)
        assert result.transport == "shm"
        assert_landed(src_pool, dst_pool)
    finally:
        free_shared_pool(src_pool)
    assert name.startswith("ty-kv-")


async def test_negotiation_prefers_inproc_and_skips_shm_without_a_shared_pool():
    src_pool = filled()
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    async with Sender(src_pool, allowed=["shm", "grpc", "inproc"]) as sender:
        sender.server.offer("a", SRC)
        sender.server.offer("b", SRC)
        async with KVTransferClient(dst_pool, LAYOUT, allowed=["inproc", "shm", "grpc"]) as client:
            assert (await client.pull(sender.endpoint, "a", SRC, DST)).transport == "inproc"
        async with KVTransferClient(dst_pool, LAYOUT, allowed=["shm", "grpc"]) as client:
            assert (await client.pull(sender.endpoint, "b", SRC, DST)).transport == "grpc"


async def test_mooncake_tcp_pull():
    if mooncake_mod.process_engine("127.0.0.1", "tcp") is None:
        pytest.skip(f"Mooncake unavailable here: {mooncake_mod.unavailable_reason()}")
    src_pool = filled()
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    async with Sender(src_pool, allowed=["mooncake", "grpc"]) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, LAYOUT, allowed=["mooncake", "grpc"]) as client:
            result = await client.pull(sender.endpoint, "r1", SRC, DST)
    assert result.transport == "mooncake"
    assert_landed(src_pool, dst_pool)


async def test_layout_mismatch_is_refused_with_a_clear_error():
    other = KVLayout(
        "other-model", "float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8
    )
    dst_pool = torch.zeros(other.pool_shape(NUM_BLOCKS))
    async with Sender(filled(), allowed=["grpc"]) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, other, allowed=["grpc"]) as client:
            with pytest.raises(KVTransferError) as err:
                await client.pull(sender.endpoint, "r1", SRC, DST)
    assert "model_id: 'tiny' != 'other-model'" in str(err.value)
    assert sender.released == ["r1"]  # the receiver will recompute: the sender frees now


async def test_a_pull_into_one_ranks_share_of_the_heads_is_refused():
    """The layout on the wire carries tp_size: a rank's pool of half the KV heads (tp=2)
    cannot take whole-head blocks (a tensor-parallel worker pulls into whole-head staging
    blocks instead, then splits them over its ranks), and the error says why."""
    half = KVLayout(
        "tiny", "float32", block_size=4, num_layers=3, num_kv_heads=1, head_dim=8, tp_size=2
    )
    dst_pool = torch.zeros(half.pool_shape(NUM_BLOCKS))
    async with Sender(filled(), allowed=["grpc"]) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, half, allowed=["grpc"]) as client:
            with pytest.raises(KVTransferError) as err:
                await client.pull(sender.endpoint, "r1", SRC, DST)
    assert "tp_size: 1 != 2" in str(err.value)
    assert "num_kv_heads: 2 != 1" in str(err.value)
    assert half.whole_heads() == LAYOUT
    assert torch.count_nonzero(dst_pool) == 0
    assert sender.released == ["r1"]


async def test_corrupt_chunk_is_detected_and_the_hold_aborted():
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    settings = KVTransferSettings(allowed=["grpc"], chunk_bytes=LAYOUT.block_nbytes)
    faults = FaultInjection(corrupt_chunk=2)
    async with Sender(filled(), settings=settings, faults=faults) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, LAYOUT, settings=settings) as client:
            with pytest.raises(KVTransferError, match="crc32"):
                await client.pull(sender.endpoint, "r1", SRC, DST)
    assert sender.released == ["r1"]
    assert torch.count_nonzero(dst_pool[DST[2:]]) == 0  # nothing of or after the bad chunk


async def test_unoffered_request_fails_fast():
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    async with Sender(filled(), allowed=["grpc"]) as sender:
        sender.server.offer("r1", [1, 2])
        async with KVTransferClient(dst_pool, LAYOUT, allowed=["grpc"]) as client:
            with pytest.raises(KVTransferError, match="NOT_FOUND"):
                await client.pull(sender.endpoint, "nope", [1], [1])
            with pytest.raises(KVTransferError, match="not offered"):
                await client.pull(sender.endpoint, "r1", [1, 3], [1, 2])


async def test_slow_sender_times_out_within_bound():
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    settings = KVTransferSettings(allowed=["grpc"], chunk_bytes=LAYOUT.block_nbytes, timeout_s=0.6)
    async with Sender(
        filled(), settings=settings, faults=FaultInjection(chunk_delay_s=0.3)
    ) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, LAYOUT, settings=settings) as client:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(KVTransferError, match="timed out"):
                await client.pull(sender.endpoint, "r1", SRC, DST)
            assert loop.time() - t0 < 0.6 + 1.5  # the timeout, then an Abort of at most 1 s
    assert sender.released == ["r1"]  # the Abort reached a live sender


async def test_unreleased_offer_is_freed_after_hold_timeout():
    async with Sender(filled(), hold_timeout_s=0.2) as sender:
        sender.server.offer("r1", SRC)
        await asyncio.sleep(0.6)
        assert sender.released == ["r1"]
        assert len(sender.server.holds) == 0


async def test_hold_ended_by_the_sender_mid_stream_fails_the_pull():
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
    settings = KVTransferSettings(allowed=["grpc"], chunk_bytes=LAYOUT.block_nbytes)
    async with Sender(
        filled(), settings=settings, faults=FaultInjection(chunk_delay_s=0.1)
    ) as sender:
        sender.server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, LAYOUT, settings=settings) as client:
            pull = asyncio.create_task(client.pull(sender.endpoint, "r1", SRC, DST))
            await asyncio.sleep(0.25)
            assert sender.server.end_hold("r1", "request cancelled") is True
            with pytest.raises(KVTransferError, match="released or expired"):
                await pull
    assert sender.released == ["r1"]  # once: the client's Abort found nothing left to free


@pytest.mark.parametrize("transport", ["inproc", "grpc"])
async def test_an_fp8_pool_moves_as_its_bytes(transport):
    """kv_cache_dtype="fp8": one byte an element, blocks a quarter of fp32's, landing bit for
    bit (e4m3 has no numpy dtype: the transports move the pool's bytes, never its numbers)."""
    layout = KVLayout("tiny", "float8_e4m3fn", 4, 3, 2, 8)
    assert layout.torch_dtype == torch.float8_e4m3fn
    assert layout.block_nbytes * 4 == LAYOUT.block_nbytes
    assert KVLayout.dtype_name(torch.float8_e4m3fn) == "float8_e4m3fn"
    src_pool = (torch.randn(layout.pool_shape(NUM_BLOCKS)) * 100).to(torch.float8_e4m3fn)
    dst_pool = torch.zeros(layout.pool_shape(NUM_BLOCKS), dtype=torch.float8_e4m3fn)
    server = KVTransferServer(src_pool, layout, on_release=lambda rid: None, allowed=[transport])
    endpoint = await server.start()
    try:
        server.offer("r1", SRC)
        async with KVTransferClient(dst_pool, layout, allowed=[transport]) as client:
            result = await client.pull(endpoint, "r1", SRC, DST)
    finally:
        await server.stop(0)
    assert result.nbytes == len(SRC) * layout.block_nbytes
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst_pool[d].view(torch.uint8), src_pool[s].view(torch.uint8))
