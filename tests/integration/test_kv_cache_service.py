"""The KV-cache service over gRPC with all three tiers (Redis from the redis_url fixture)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import pytest
import redis.asyncio as redis
import torch

from tokenyard.bus.embedded import free_port
from tokenyard.kv.hashing import prefix_block_hashes
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.client import KVCacheClient, KVCacheError
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
NB = LAYOUT.block_nbytes + 4  # framed


@pytest.fixture
async def service(tmp_path, redis_url):
    prefix = f"ty:test:{uuid.uuid4().hex[:8]}:"
    settings = KVCacheSettings(
        port=0,
        ram_bytes=4 * NB,
        redis_url=redis_url,
        redis_prefix=prefix,
        redis_ttl_s=60,
        redis_bytes=4 * NB,
        disk_dir=str(tmp_path / "kv"),
        disk_bytes=100 * NB,
        shutdown_grace_s=0,
    )
    server = await serve(settings)
    yield server
    await server.stop()
    cleanup = redis.from_url(redis_url)
    keys = [k async for k in cleanup.scan_iter(match=prefix + "*")]
    if keys:
        await cleanup.delete(*keys)
    await cleanup.aclose()


def pool(n: int = 32, seed: int | None = None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(LAYOUT.pool_shape(n))
    return torch.randn(LAYOUT.pool_shape(n), generator=torch.Generator().manual_seed(seed))


async def test_put_then_prefix_hit_through_all_tiers(service):
    tokens = list(range(4 * 10 + 3))  # 10 full blocks
    hashes = prefix_block_hashes(tokens, LAYOUT.block_size)
    src = pool(seed=1)
    src_ids = list(range(5, 15))
    async with KVCacheClient(service.endpoint) as client:
        assert await client.put_blocks(LAYOUT, hashes, src, src_ids) == 10
        stats = await client.stats()
        by_tier = {t.name: t for t in stats.tiers}
        # 10 blocks through a RAM of 4 and a Redis of 4: 2 are on disk.
        assert [by_tier[n].blocks for n in ("ram", "redis", "disk")] == [4, 4, 2]
        assert await client.contains(LAYOUT, hashes) == 10

        dst = pool()
        dst_ids = list(range(20, 30))
        assert await client.get_prefix(LAYOUT, hashes, dst, dst_ids) == 10
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(dst[d], src[s])
        stats = await client.stats()
        assert stats.hits == 10 and stats.misses == 0
        assert {t.name: t.hits for t in stats.tiers}["disk"] >= 2


async def test_prefix_stops_at_the_first_missing_block(service):
    hashes = prefix_block_hashes(list(range(4 * 6)), LAYOUT.block_size)
    src = pool(seed=2)
    async with KVCacheClient(service.endpoint) as client:
        await client.put_blocks(LAYOUT, hashes[:3] + hashes[4:], src, [0, 1, 2, 4, 5])
        assert await client.contains(LAYOUT, hashes) == 3
        dst = pool()
        assert await client.get_prefix(LAYOUT, hashes, dst, list(range(10, 16))) == 3
        assert not dst[13:].any()
        assert (await client.stats()).misses == 1


async def test_other_layout_misses_and_foreign_hash_spec_is_refused(service):
    hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
    other = KVLayout("other-model", "float32", 4, 2, 2, 8)
    foreign = KVLayout("tiny", "float32", 4, 2, 2, 8, hash_version="someone-else-v9")
    async with KVCacheClient(service.endpoint) as client:
        await client.put_blocks(LAYOUT, hashes, pool(seed=3), [0, 1])
        assert await client.get_prefix(other, hashes, torch.zeros(other.pool_shape(4)), [0, 1]) == 0
        with pytest.raises(KVCacheError, match="hash spec"):
            await client.get_prefix(foreign, hashes, torch.zeros(foreign.pool_shape(4)), [0, 1])


async def test_standalone_service_starts_and_stops_on_sigterm(tmp_path):
    port = free_port()
    env = dict(
        os.environ, TOKENYARD_KVCACHE_PORT=str(port), TOKENYARD_KVCACHE_DISK_DIR=str(tmp_path)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.services.kvcache"], env=env, stderr=subprocess.PIPE
    )
    try:
        async with KVCacheClient(f"127.0.0.1:{port}", timeout_s=2) as client:
            for _ in range(100):
                try:
                    stats = await client.stats()
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            else:
                pytest.fail("the KV cache never answered")
        assert [t.name for t in stats.tiers] == ["ram", "disk"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
        proc.wait()


async def test_put_of_a_block_of_the_wrong_size_is_refused(service):
    import grpc

    from tokenyard.kv.layout import layout_to_proto
    from tokenyard.v1 import kv_pb2, kv_pb2_grpc

    async def blocks():
        yield kv_pb2.PutBlock(layout=layout_to_proto(LAYOUT), hash=1, data=b"short", crc32=0)

    async with grpc.aio.insecure_channel(service.endpoint) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv_pb2_grpc.KVCacheStub(channel).Put(blocks())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "has 5 bytes; layout says" in err.value.details()
