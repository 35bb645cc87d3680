"""A worker's offload bookkeeping: the bandwidth budget and the hashes already sent."""

from __future__ import annotations

from tokenyard.kv.store.offload import BandwidthBudget, RecentHashes


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_budget_covers_leading_blocks_and_refills_with_time():
    clock = Clock()
    budget = BandwidthBudget(bytes_per_s=1000, burst_s=1.0, clock=clock)
    assert budget.take_blocks(5, 300) == 3  # 900 of 1000 bytes
    assert budget.take_blocks(1, 300) == 0  # 100 left
    clock.t = 0.5  # +500 bytes
    assert budget.take_blocks(4, 300) == 2
    clock.t = 100.0  # a long quiet spell refills one burst, not more
    assert budget.take_blocks(10, 100) == 10
    assert budget.take_blocks(1, 100) == 0


def test_budget_takes_back_what_was_not_sent():
    clock = Clock()
    budget = BandwidthBudget(bytes_per_s=1000, clock=clock)
    assert budget.take_blocks(3, 300) == 3
    budget.give_back(600)  # two of them were evicted before the copy-out
    assert budget.take_blocks(3, 300) == 2


def test_zero_budget_means_no_limit():
    budget = BandwidthBudget(bytes_per_s=0)
    assert budget.unlimited
    assert budget.take_blocks(10_000, 1 << 20) == 10_000
    assert budget.take_blocks(0, 1 << 20) == 0


def test_unsent_starts_at_the_first_block_the_service_may_lack():
    sent = RecentHashes(capacity=100)
    sent.add([1, 2, 3])
    assert sent.unsent([1, 2, 3, 4, 5]) == [4, 5]
    assert sent.unsent([1, 9, 3]) == [9, 3]  # a chain stays whole after a gap
    assert sent.unsent([1, 2]) == []


def test_recent_hashes_forget_the_oldest_and_the_expired():
    clock = Clock()
    sent = RecentHashes(capacity=3, ttl_s=10.0, clock=clock)
    sent.add([1, 2, 3, 4])
    assert 1 not in sent and all(h in sent for h in (2, 3, 4))
    clock.t = 5.0
    sent.add([2])  # seen again: kept longer
    clock.t = 12.0
    assert 2 in sent and 3 not in sent and 4 not in sent  # the service may have evicted them
    sent.add([5])
    assert len(sent) == 2  # the expired ones were dropped
