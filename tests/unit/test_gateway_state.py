"""Pure state of the gateway: token buckets (its view of the workers is tests/unit/test_fleet.py)."""

from __future__ import annotations

import pytest

from tokenyard.services.gateway.ratelimit import MemoryBuckets, make_limiter, retry_after


async def test_bucket_allows_a_burst_then_refills_at_the_rate():
    now = [100.0]
    buckets = MemoryBuckets(rate=2.0, burst=3, clock=lambda: now[0])
    assert [await buckets.take("a") for _ in range(3)] == [None, None, None]
    wait = await buckets.take("a")
    assert wait == pytest.approx(0.5) and retry_after(wait) == 1
    assert await buckets.take("b") is None  # keys are independent
    now[0] += 0.5
    assert await buckets.take("a") is None
    assert await buckets.take("a") == pytest.approx(0.5)
    now[0] += 100
    assert [await buckets.take("a") for _ in range(4)][:3] == [None, None, None]  # capped at burst


def test_limiter_choice():
    assert type(make_limiter(0, 5, None)).__name__ == "NoLimit"
    assert type(make_limiter(1, 5, None)).__name__ == "MemoryBuckets"
