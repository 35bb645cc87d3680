"""Per-key limits per minute (requests, tokens), shared by every gateway through Redis.

A fixed one-minute window per key and kind, as OpenAI counts them: a request is refused
(429) when it would take the minute's count past the key's limit, and is told how many
seconds remain in the window. Tokens are charged up front: the prompt plus max_tokens.

    wait = await limits.take("tpm:ab12cd34", limit=10_000, cost=1_200)   # None = go
"""

from __future__ import annotations

import time
from typing import Protocol

from tokenyard.services.gateway.ratelimit import connect_redis, redis_problem, store_unavailable

WINDOW_S = 60


class MinuteLimits(Protocol):
    async def take(self, counter: str, limit: int, cost: int) -> float | None:
        """None = go, else the seconds left in the window; a 503 ApiError while the Redis is
        unreachable (ratelimit.store_unavailable)."""
        ...

    async def problem(self) -> str | None:
        """Why counts cannot be taken now (None: they can)."""
        ...

    async def close(self) -> None: ...


def window_start(now: float) -> int:
    return int(now) - int(now) % WINDOW_S


class MemoryMinuteLimits:
    """One gateway's own counts (no Redis configured)."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self._counts: dict[tuple[str, int], int] = {}

    async def take(self, counter: str, limit: int, cost: int) -> float | None:
        now = self.clock()
        slot = window_start(now)
        used = self._counts.get((counter, slot), 0)
        if used + cost > limit:
            return slot + WINDOW_S - now
        # Only this minute's counts are kept.
        self._counts = {k: v for k, v in self._counts.items() if k[1] == slot}
        self._counts[(counter, slot)] = used + cost
        return None

    async def problem(self) -> str | None:
        return None

    async def close(self) -> None:
        return None


# Atomic in Redis: refuse when the cost would pass the limit, else add it to this minute.
_TAKE = """
local limit = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local slot = math.floor(now) - (math.floor(now) % window)
local key = KEYS[1] .. ':' .. slot
local used = tonumber(redis.call('GET', key) or '0')
if used + cost > limit then
  return tostring(slot + window - now)
end
redis.call('INCRBY', key, cost)
redis.call('EXPIRE', key, window * 2)
return '0'
"""


class RedisMinuteLimits:
    def __init__(self, url: str, prefix: str = "ty:gateway:minute:") -> None:
        self.redis = connect_redis(url)
        self.prefix = prefix
        self._script = self.redis.register_script(_TAKE)

    async def take(self, counter: str, limit: int, cost: int) -> float | None:
        from redis.exceptions import RedisError

        args = [limit, cost, WINDOW_S]
        try:
            reply = await self._script(keys=[self.prefix + counter], args=args)
        except RedisError as exc:
            raise store_unavailable(exc) from exc
        wait = float(reply)
        return wait if wait > 0 else None

    async def problem(self) -> str | None:
        return await redis_problem(self.redis)

    async def close(self) -> None:
        await self.redis.aclose()


def make_minute_limits(redis_url: str | None) -> MinuteLimits:
    return RedisMinuteLimits(redis_url) if redis_url else MemoryMinuteLimits()
