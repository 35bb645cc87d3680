"""Pulls from a sender in another process, over each transport that crosses processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

from tokenyard.kv.layout import KVLayout
from tokenyard.kv.transfer import KVTransferClient, KVTransferServer, allocate_shared_pool
from tokenyard.kv.transfer import mooncake as mooncake_mod

LAYOUT = KVLayout("tiny", "bfloat16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=32)
NUM_BLOCKS = 24
SRC = [5, 6, 7, 20, 2, 11]
DST = [0, 1, 2, 3, 9, 23]
TRANSPORTS = ["shm", "mooncake", "grpc"]


def source_pool() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(LAYOUT.pool_shape(NUM_BLOCKS), generator=g).to(torch.bfloat16)


def _sender(endpoints: mp.Queue, done) -> None:
    async def main() -> None:
        pool, _ = allocate_shared_pool(LAYOUT, NUM_BLOCKS)
        pool.copy_(source_pool())
        server = KVTransferServer(pool, LAYOUT, on_release=lambda rid: None)
        endpoints.put(await server.start())
        for rid in [*TRANSPORTS, "auto"]:
            server.offer(rid, SRC)
        await asyncio.to_thread(done.wait, 60)
        await server.stop(0)

    asyncio.run(main())


@pytest.fixture(scope="module")
def sender():
    ctx = mp.get_context("spawn")
    endpoints, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_sender, args=(endpoints, done), daemon=True)
    proc.start()
    try:
        yield endpoints.get(timeout=60)
    finally:
        done.set()
        proc.join(10)
        proc.kill()
        proc.join()


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_pull_from_another_process(sender, transport):
    if transport == "mooncake" and mooncake_mod.process_engine("127.0.0.1", "tcp") is None:
        pytest.skip(f"Mooncake unavailable here: {mooncake_mod.unavailable_reason()}")
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS), dtype=torch.bfloat16)
    async with KVTransferClient(dst_pool, LAYOUT, allowed=[transport]) as client:
        result = await client.pull(sender, transport, SRC, DST)
    assert result.transport == transport
    expected = source_pool()
    for s, d in zip(SRC, DST, strict=True):
        assert torch.equal(dst_pool[d], expected[s])
    assert not dst_pool[[i for i in range(NUM_BLOCKS) if i not in DST]].any()


async def test_default_negotiation_picks_shm_on_one_host(sender):
    dst_pool = torch.zeros(LAYOUT.pool_shape(NUM_BLOCKS), dtype=torch.bfloat16)
    async with KVTransferClient(dst_pool, LAYOUT) as client:
        assert (await client.pull(sender, "auto", SRC, DST)).transport == "shm"


def _attach_and_exit(name: str, nbytes: int) -> None:
    from tokenyard.kv.transfer.shm import Attached

    attached = Attached(name, nbytes)
    assert attached.bytes is not None and attached.bytes.numel() == nbytes
    attached.close()


def test_a_peer_that_maps_a_pool_never_unlinks_it():
    from pathlib import Path

    from tokenyard.kv.transfer import free_shared_pool

    pool, name = allocate_shared_pool(LAYOUT, 4)
    segment = Path("/dev/shm") / name
    try:
        ctx = mp.get_context("spawn")
        for _ in range(2):  # a spawned child shares our resource tracker: still ours after
            child = ctx.Process(target=_attach_and_exit, args=(name, pool.nbytes))
            child.start()
            child.join(60)
            assert child.exitcode == 0
        assert segment.exists()
    finally:
        free_shared_pool(pool)
    assert not segment.exists()


def _own_a_pool(names: mp.Queue, done) -> None:
    pool, name = allocate_shared_pool(LAYOUT, 4)
    names.put((name, pool.nbytes))
    done.wait(60)


def test_a_pool_is_unlinked_when_its_owner_exits_even_after_peers_mapped_it():
    from pathlib import Path

    from tokenyard.kv.transfer.shm import Attached

    ctx = mp.get_context("spawn")
    names, done = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_own_a_pool, args=(names, done))
    owner.start()
    try:
        name, nbytes = names.get(timeout=60)
        Attached(name, nbytes).close()
        assert (Path("/dev/shm") / name).exists()
        done.set()
        owner.join(30)
        assert owner.exitcode == 0
        assert not (Path("/dev/shm") / name).exists()
    finally:
        owner.kill()
        owner.join()
