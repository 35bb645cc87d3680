"""Pure state of the gateway: token buckets and the table of live workers."""

from __future__ import annotations

import pytest

from tokenyard.services.gateway.ratelimit import MemoryBuckets, make_limiter, retry_after
from tokenyard.services.gateway.workers import WorkerTable
from tokenyard.v1 import serving_pb2 as pb


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


def hb(worker_id: str, role: str, **kw) -> pb.WorkerHeartbeat:
    return pb.WorkerHeartbeat(
        worker_id=worker_id, role=role, model="m", heartbeat_interval_ms=1000, **kw
    )


def test_worker_table_liveness_roles_and_context():
    table = WorkerTable(missed_heartbeats=3)
    assert table.missing_role(0) == "prefill"
    table.on_heartbeat(hb("p", "prefill", max_model_len=2048), now=0)
    assert table.missing_role(0) == "decode"
    table.on_heartbeat(hb("d", "decode", max_model_len=1024), now=1)
    assert table.missing_role(1) is None and table.max_model_len(1) == 1024
    assert table.roles(1) == {"prefill": 1, "decode": 1}
    # 3 missed beats of 1 s: p (last seen at 0) is dead at 3.5, d (at 1) is not
    assert table.is_dead("p", 3.5) and not table.is_dead("d", 3.5)
    assert not table.is_dead("never-seen", 3.5)
    assert table.missing_role(3.5) == "prefill" and table.max_model_len(3.5) == 1024


def test_a_both_worker_serves_every_role():
    table = WorkerTable()
    table.on_heartbeat(hb("b", "both"), now=0)
    assert table.missing_role(0) is None and table.models(0) == {"m"}
