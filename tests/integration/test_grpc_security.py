"""Internal gRPC with the stack's token: the KV-cache service takes blocks only from callers
that present it (the workers), and refuses everyone else with UNAUTHENTICATED."""

from __future__ import annotations

import pytest
import torch

from tokenyard.kv.hashing import prefix_block_hashes
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.client import KVCacheClient, KVCacheError
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
TOKEN = "stack-token-for-tests"


@pytest.fixture
async def service(monkeypatch):
    monkeypatch.setenv("TOKENYARD_GRPC_TOKEN", TOKEN)
    server = await serve(KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0))
    yield server
    await server.stop()


def client_with(monkeypatch, token: str | None, endpoint: str) -> KVCacheClient:
    if token is None:
        monkeypatch.delenv("TOKENYARD_GRPC_TOKEN", raising=False)
    else:
        monkeypatch.setenv("TOKENYARD_GRPC_TOKEN", token)
    return KVCacheClient(endpoint)


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_a_caller_without_the_stack_token_can_neither_put_nor_read(
    service, monkeypatch, token
):
    hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
    pool = torch.randn(LAYOUT.pool_shape(4))
    async with client_with(monkeypatch, token, service.endpoint) as stranger:
        with pytest.raises(KVCacheError, match="UNAUTHENTICATED"):
            await stranger.put_blocks(LAYOUT, hashes, pool, [0, 1])
        with pytest.raises(KVCacheError, match="UNAUTHENTICATED"):
            await stranger.contains(LAYOUT, hashes)
    async with client_with(monkeypatch, TOKEN, service.endpoint) as worker:
        assert (await worker.stats()).hits == 0
        assert await worker.contains(LAYOUT, hashes) == 0  # nothing was planted


async def test_a_worker_with_the_token_puts_and_reads(service, monkeypatch):
    hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
    src = torch.randn(LAYOUT.pool_shape(4))
    async with client_with(monkeypatch, TOKEN, service.endpoint) as worker:
        assert await worker.put_blocks(LAYOUT, hashes, src, [0, 1]) == 2
        dst = torch.zeros(LAYOUT.pool_shape(4))
        assert await worker.get_prefix(LAYOUT, hashes, dst, [2, 3]) == 2
        assert torch.equal(dst[2:], src[:2])
