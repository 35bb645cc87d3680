"""The waiting order: priority classes, fair shares of tokens between tenants, arrival."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tokenyard.engine.fair_queue import FairQueue, QueueKey, check_policy, check_priority


@dataclass(eq=False)
class Job:
    name: str
    tenant: str = ""
    priority: int = 0
    arrival: int = 0
    tokens: int = 10


def queue(policy="fair"):
    return FairQueue[Job](
        key=lambda j: QueueKey(j.priority, j.tenant, j.arrival),
        cost=lambda j: j.tokens,
        policy=policy,
    )


def names(jobs):
    return [j.name for j in jobs]


def test_fcfs_ignores_priority_and_puts_a_preempted_job_in_front():
    q = queue("fcfs")
    for i, p in enumerate([5, -5, 0]):
        q.push(Job(f"j{i}", priority=p, arrival=i))
    q.push(Job("back", arrival=-1), front=True)
    assert names(q.ordered()) == ["back", "j0", "j1", "j2"]


def test_priority_orders_classes_then_arrival():
    q = queue("priority")
    for i, p in enumerate([5, -5, 0, -5]):
        q.push(Job(f"j{i}", priority=p, arrival=i))
    assert names(q.ordered()) == ["j1", "j3", "j2", "j0"]


def test_fair_interleaves_a_noisy_tenant_with_a_quiet_one():
    q = queue()
    for i in range(10):
        q.push(Job(f"n{i}", tenant="noisy", arrival=i))
    q.push(Job("q0", tenant="quiet", arrival=10))
    q.push(Job("q1", tenant="quiet", arrival=11))
    # Both start at the same virtual time: turns by tokens, the earlier job on a tie.
    assert names(q.ordered())[:5] == ["n0", "q0", "n1", "q1", "n2"]


def test_fair_lets_the_tenant_served_less_go_first():
    q = queue()
    q.push(Job("n0", tenant="noisy", arrival=0))
    q.push(Job("q0", tenant="quiet", arrival=1))
    q.charge("noisy", 100)  # its running sequences were served
    assert names(q.ordered()) == ["q0", "n0"]
    q.charge("quiet", 1000)
    assert names(q.ordered()) == ["n0", "q0"]


def test_idle_time_is_no_credit():
    q = queue()
    q.charge("noisy", 10_000)
    q.push(Job("n0", tenant="noisy", arrival=0))
    q.push(Job("q0", tenant="quiet", arrival=1))  # lifted to the waiting tenants' time
    assert q.served("quiet") == 10_000
    assert names(q.ordered()) == ["n0", "q0"]


def test_priority_beats_fair_share():
    q = queue()
    q.charge("a", 1000)
    q.push(Job("b0", tenant="b", arrival=0))
    q.push(Job("a0", tenant="a", priority=-1, arrival=1))
    assert names(q.ordered()) == ["a0", "b0"]


def test_counts_by_tenant_and_removal():
    q = queue()
    jobs = [Job("a0", "a"), Job("a1", "a"), Job("b0", "b")]
    for j in jobs:
        q.push(j)
    q.remove(jobs[0])
    assert q.waiting_by_tenant() == {"a": 1, "b": 1}
    assert len(q) == 2 and jobs[0] not in q


def test_bad_policy_and_priority_are_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        check_policy("lifo")
    with pytest.raises(ValueError, match="priority must be in"):
        check_priority(101)
    assert check_priority(-100) == -100
