"""KV hand-offs that go wrong across processes: a sender killed or frozen mid-transfer, a
receiver that vanishes. Each must end within bounded time with the blocks freed."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal

import pytest
import torch

from tokenyard.kv.layout import KVLayout
from tokenyard.kv.transfer import (
    FaultInjection,
    KVTransferClient,
    KVTransferError,
    KVTransferServer,
    KVTransferSettings,
)

LAYOUT = KVLayout("tiny", "float32", block_size=16, num_layers=4, num_kv_heads=2, head_dim=16)
NUM_BLOCKS = 32
SRC = list(range(20))
DST = list(range(31, 11, -1))
SETTINGS = KVTransferSettings(
    allowed=["grpc"], chunk_bytes=LAYOUT.block_nbytes, timeout_s=8.0, stall_timeout_s=1.0
)


def source_pool() -> torch.Tensor:
    return torch.randn(LAYOUT.pool_shape(NUM_BLOCKS), generator=torch.Generator().manual_seed(7))


def _serve_slowly(endpoints: mp.Queue) -> None:
    async def main() -> None:
        server = KVTransferServer(
            source_pool(),
            LAYOUT,
            on_release=lambda rid: None,
            settings=SETTINGS,
            faults=FaultInjection(chunk_delay_s=0.15),
        )
        endpoints.put(await server.start())
        server.offer("r1", SRC)
        await asyncio.sleep(60)

    asyncio.run(main())


def _pull(endpoint: str, ready, go) -> None:
    async def main() -> None:
        pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
        client = KVTransferClient(pool, LAYOUT, settings=SETTINGS)
        ready.set()
        await asyncio.to_thread(go.wait, 60)
        await client.pull(endpoint, "r1", SRC, DST)

    asyncio.run(main())


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


async def wait_until(predicate, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
async def test_sender_dies_or_freezes_mid_transfer(ctx, how):
    endpoints = ctx.Queue()
    sender = ctx.Process(target=_serve_slowly, args=(endpoints,), daemon=True)
    sender.start()
    try:
        endpoint = await asyncio.to_thread(endpoints.get, True, 60)
        dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
        async with KVTransferClient(dst_pool, LAYOUT, settings=SETTINGS) as client:
            pull = asyncio.create_task(client.pull(endpoint, "r1", SRC, DST))
            await wait_until(lambda: bool(dst_pool[DST[2]].any()), timeout=10)
            os.kill(sender.pid, how)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(KVTransferError):
                await pull
            # dead: the connection resets at once; frozen: the stall timeout (1 s) fires.
            assert loop.time() - t0 < SETTINGS.stall_timeout_s + 1.5
    finally:
        sender.kill()
        sender.join(10)
    expected = source_pool()
    landed = [i for i, d in enumerate(DST) if dst_pool[d].any()]
    assert 3 <= len(landed) < len(SRC)
    assert landed == list(range(len(landed)))  # a prefix, in order
    for i in landed[:-1]:  # the last one may be partial
        assert torch.equal(dst_pool[DST[i]], expected[SRC[i]])
    untouched = sorted(set(range(NUM_BLOCKS)) - set(DST))
    assert not dst_pool[untouched].any()


async def test_vanished_receiver_blocks_are_freed_after_hold_timeout(ctx):
    released: list[str] = []
    server = KVTransferServer(
        source_pool(),
        LAYOUT,
        on_release=released.append,
        settings=SETTINGS,
        hold_timeout_s=1.0,
        faults=FaultInjection(chunk_delay_s=0.15),
    )
    endpoint = await server.start()
    ready, go = ctx.Event(), ctx.Event()
    receiver = ctx.Process(target=_pull, args=(endpoint, ready, go), daemon=True)
    receiver.start()
    try:
        assert await asyncio.to_thread(ready.wait, 60)
        server.offer("r1", SRC)
        go.set()
        await asyncio.sleep(1.5)  # mid-stream by now: 20 chunks take 3 s, each touches the hold
        assert released == []
        receiver.kill()
        await asyncio.to_thread(receiver.join, 10)
        await wait_until(lambda: released == ["r1"], timeout=3.0)
        await asyncio.sleep(0.5)
        assert released == ["r1"]  # once, not again
    finally:
        receiver.kill()
        receiver.join(10)
        await server.stop(0)


def _serve_mooncake(endpoints: mp.Queue) -> None:
    async def main() -> None:
        server = KVTransferServer(
            source_pool(), LAYOUT, on_release=lambda rid: None, allowed=["mooncake"]
        )
        endpoints.put(await server.start())
        for i in range(10_000):
            server.offer(f"r{i}", SRC)
        await asyncio.sleep(60)

    asyncio.run(main())


async def test_sender_killed_during_mooncake_reads(ctx):
    from tokenyard.kv.transfer import mooncake

    if mooncake.process_engine("127.0.0.1", "tcp") is None:
        pytest.skip(f"Mooncake unavailable here: {mooncake.unavailable_reason()}")
    endpoints = ctx.Queue()
    sender = ctx.Process(target=_serve_mooncake, args=(endpoints,), daemon=True)
    sender.start()
    settings = KVTransferSettings(allowed=["mooncake"], timeout_s=5.0)
    try:
        endpoint = await asyncio.to_thread(endpoints.get, True, 60)
        dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS))
        async with KVTransferClient(dst_pool, LAYOUT, settings=settings) as client:
            loop = asyncio.get_running_loop()
            killer = loop.call_later(1.0, os.kill, sender.pid, signal.SIGKILL)
            pulled = 0
            with pytest.raises(KVTransferError):  # wherever the kill lands: Describe or a read
                while True:
                    t0 = loop.time()
                    await client.pull(endpoint, f"r{pulled}", SRC, DST)
                    pulled += 1
            assert loop.time() - t0 < settings.timeout_s + 1
            killer.cancel()
        assert pulled > 0
    finally:
        sender.kill()
        sender.join(10)
