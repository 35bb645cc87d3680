"""Per-key token buckets: in memory for one gateway, in Redis when gateways share the limit.

``take(key)`` returns None when the request may go, else the seconds to wait (Retry-After).
"""

from __future__ import annotations

import math
import time
from typing import Protocol


class RateLimiter(Protocol):
    async def take(self, key: str) -> float | None: ...

    async def close(self) -> None: ...


def refill(tokens: float, last: float, now: float, rate: float, burst: int) -> float:
    return min(float(burst), tokens + max(0.0, now - last) * rate)


def wait_for_one(tokens: float, rate: float) -> float:
    return (1.0 - tokens) / rate


class NoLimit:
    async def take(self, key: str) -> float | None:
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
        from redis.asyncio import Redis

        self.redis = Redis.from_url(url)
        self.rate, self.burst, self.prefix = rate, burst, prefix
        self._script = self.redis.register_script(_TAKE)

    async def take(self, key: str) -> float | None:
        wait = float(await self._script(keys=[self.prefix + key], args=[self.rate, self.burst]))
        return wait if wait > 0 else None

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
