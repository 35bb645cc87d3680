"""The worker's admission gate lets waiters in by priority, then fair share, under its cap."""

from __future__ import annotations

import asyncio

import pytest

from tokenyard.services.worker.admission import AdmissionGate


async def _let_in_order(gate: AdmissionGate, waiters: list[tuple[str, int, str]]) -> list[str]:
    order: list[str] = []

    async def wait(name: str, priority: int, tenant: str) -> None:
        await gate.acquire(priority, tenant, 10)
        order.append(name)

    tasks = []
    for name, priority, tenant in waiters:
        tasks.append(asyncio.create_task(wait(name, priority, tenant)))
        await asyncio.sleep(0)  # queued in this order
    assert gate.waiting == len(waiters)
    for _ in waiters:
        gate.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


async def test_waiters_go_in_by_priority_then_fair_share():
    gate = AdmissionGate(lambda: 1)
    await gate.acquire()  # the one running sequence
    order = await _let_in_order(
        gate, [("a1", 0, "a"), ("a2", 0, "a"), ("a3", 0, "a"), ("b1", 0, "b"), ("vip", -5, "c")]
    )
    assert order == ["vip", "a1", "b1", "a2", "a3"]


async def test_fcfs_lets_them_in_by_arrival():
    gate = AdmissionGate(lambda: 1, "fcfs")
    await gate.acquire()
    order = await _let_in_order(gate, [("a1", 0, "a"), ("a2", 0, "a"), ("vip", -5, "c")])
    assert order == ["a1", "a2", "vip"]


async def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_place():
    gate = AdmissionGate(lambda: 1)
    await gate.acquire()
    task = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    assert gate.waiting == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.waiting == 0 and gate.admitted == 1
    gate.release()
    assert gate.admitted == 0
