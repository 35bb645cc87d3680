"""Per-key token buckets: in memory for one gateway, in Redis when gateways share the limit.

``take(key)`` returns None when the request may go, else the seconds to wait (Retry-After);
while the Redis is unreachable it raises a 503 ApiError (``store_unavailable``), and
``problem()`` says why for /ready.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Protocol

from tokenyard.api_errors import ApiError

# A Redis that hangs must not hang the request: the limit check fails fast instead.
REDIS_TIMEOUT_S = 2.0
PING_TIMEOUT_S = 0.5


class RateLimiter(Protocol):
    async def take(self, key: str) -> float | None: ...

    async def problem(self) -> str | None:
        """Why limits cannot be checked now (None: they can)."""
        ...

    async def close(self) -> None: ...


def connect_redis(url: str) -> Any:
    from redis.asyncio import Redis

    return Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )


def store_unavailable(exc: Exception) -> ApiError:
    """A limited request while the Redis is unreachable: 503, not a 500 or a free pass."""
    return ApiError(
        503,
        f"the rate limit store (Redis) is unreachable ({type(exc).__name__}); retry shortly",
        code="rate_limit_store_unavailable",
        retry_after_s=1,
    )


async def redis_problem(redis: Any) -> str | None:
    """None when the Redis answers PING within PING_TIMEOUT_S, else why not."""
    from redis.exceptions import RedisError

    try:
        await asyncio.wait_for(redis.ping(), PING_TIMEOUT_S)
    except (RedisError, OSError, TimeoutError) as exc:
        return f"the rate limit store (Redis) does not answer ({type(exc).__name__})"
    return None


def refill(tokens: float, last: float, now: float, rate: float, burst: int) -> float:
    return min(float(burst), tokens + max(0.0, now - last) * rate)


def wait_for_one(tokens: float, rate: float) -> float:
    return (1.0 - tokens) / rate


class NoLimit:
    async def take(self, key: str) -> float | None:
        return None

    async def problem(self) -> str | None:
        return None

    async def close(self) -> None:
        return None


class MemoryBuckets:
    def __init__(self, rate: float, burst: int, clock=time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}

    async def take(self, key: str) -> float | None:
        now = self.clock()
        tokens, last = self._buckets.get(key, (float(self.burst), now))
        tokens = refill(tokens, last, now, self.rate, self.burst)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return wait_for_one(tokens, self.rate)
        self._buckets[key] = (tokens - 1.0, now)
        return None

    async def problem(self) -> str | None:
        return None

    async def close(self) -> None:
        return None


# Atomic in Redis: read the bucket, refill it, take one token or say how long to wait.
_TAKE = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local b = redis.call('HMGET', KEYS[1], 'tokens', 'last')
local tokens = tonumber(b[1]) or burst
local last = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - last) * rate)
local wait = 0
if tokens < 1 then
  wait = (1 - tokens) / rate
else
  tokens = tokens - 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'last', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return tostring(wait)
"""


class RedisBuckets:
    def __init__(
        self, url: str, rate: float, burst: int, prefix: str = "ty:gateway:ratelimit:"
    ) -> None:
        self.redis = connect_redis(url)
        self.rate, self.burst, self.prefix = rate, burst, prefix
        self._script = self.redis.register_script(_TAKE)

    async def take(self, key: str) -> float | None:
        from redis.exceptions import RedisError

        try:
            reply = await self._script(keys=[self.prefix + key], args=[self.rate, self.burst])
        except RedisError as exc:
            raise store_unavailable(exc) from exc
        wait = float(reply)
        return wait if wait > 0 else None

    async def problem(self) -> str | None:
        return await redis_problem(self.redis)

    async def close(self) -> None:
        await self.redis.aclose()


def make_limiter(rate: float, burst: int, redis_url: str | None) -> RateLimiter:
    if rate <= 0:
        return NoLimit()
    if redis_url:
        return RedisBuckets(redis_url, rate, burst)
    return MemoryBuckets(rate, burst)


def retry_after(wait_s: float) -> int:
    return max(1, math.ceil(wait_s))
