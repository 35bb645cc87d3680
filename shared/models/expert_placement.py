"""Where each expert of a sparse layer lives under expert parallelism, and how to move them
so that the ranks share the routed tokens evenly (an expert-placement load balancer, EPLB).

A layer's placement is one list over its physical slots: `world` ranks of `slots_per_rank`
slots each, slot p on rank p // slots_per_rank holding the logical expert `slots[p]`. Every
expert has at least one slot; the spare ("redundant") slots hold replicas of hot experts,
and a token routed to an expert with n replicas goes to one of them by its row (so each
replica takes about 1/n of the expert's tokens).

    E = 4 experts, world = 2, slots_per_rank = 3 (2 own + 1 redundant):
      rank 0: [e0 e1 | e2]     rank 1: [e2 e3 | e0]      slots = [0, 1, 2, 2, 3, 0]

`rebalance` is DeepSeek's EPLB recipe in two greedy passes (pure, list-based, the same on
every rank): give the spare slots, one at a time, to the expert with the most tokens per
replica; then pack the replicas heaviest first onto the least loaded rank with a free slot.
A last pass matches the packed ranks to the current ones and keeps experts in the slots
they already hold, so only the experts that really move are copied between ranks.
"""

from __future__ import annotations

Placement = list[int]  # physical slot -> logical expert id, world * slots_per_rank long


def initial_placement(num_experts: int, world: int, redundant: int) -> Placement:
    """Rank r holds experts [r*E/w, (r+1)*E/w) and, in its `redundant` spare slots,
    replicas of the next ranks' experts (a placement before any token was counted)."""
    per_rank = num_experts // world
    slots: Placement = []
    for rank in range(world):
        own = range(rank * per_rank, (rank + 1) * per_rank)
        spare = (((rank + 1) * per_rank + j) % num_experts for j in range(redundant))
        slots += [*own, *spare]
    return slots


def replica_counts(slots: Placement, num_experts: int) -> list[int]:
    counts = [0] * num_experts
    for e in slots:
        counts[e] += 1
    return counts


def rank_loads(counts: list[int], slots: Placement, world: int) -> list[float]:
    """Tokens each rank runs under `slots` when expert e takes counts[e] tokens, split
    evenly between its replicas."""
    replicas = replica_counts(slots, len(counts))
    per_rank = len(slots) // world
    loads = [0.0] * world
    for p, e in enumerate(slots):
        loads[p // per_rank] += counts[e] / replicas[e]
    return loads


def imbalance(loads: list[float]) -> float:
    """max / mean of the ranks' loads: 1.0 is perfect balance (and no load at all)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


# A new placement is taken only when it lowers max/mean by at least this factor: a copy of
# weights for a gain within the counts' noise is not worth the pause.
MIN_GAIN = 0.98


def rebalance(counts: list[int], current: Placement, world: int) -> Placement:
    """A placement of the same shape as `current` whose per-rank load under `counts` is as
    even as the greedy passes make it, keeping experts where they are where it can;
    `current` itself where that would not lower the imbalance by MIN_GAIN."""
    per_rank = len(current) // world
    replicas = _replicate(counts, len(current))
    bins = _pack(counts, replicas, world, per_rank)
    new = _keep_in_place(bins, current, world, per_rank)
    before = imbalance(rank_loads(counts, current, world))
    return new if imbalance(rank_loads(counts, new, world)) < before * MIN_GAIN else current


def _replicate(counts: list[int], num_slots: int) -> list[int]:
    """One slot per expert, then each spare slot to the expert with the most tokens per
    replica (ties: the lower id)."""
    replicas = [1] * len(counts)
    for _ in range(num_slots - len(counts)):
        hot = max(range(len(counts)), key=lambda e: (counts[e] / replicas[e], -e))
        replicas[hot] += 1
    return replicas


def _pack(counts: list[int], replicas: list[int], world: int, per_rank: int) -> list[list[int]]:
    """Longest-processing-time packing with a capacity: heaviest replica first, onto the
    least loaded rank that has a free slot (and, if it can, no replica of that expert)."""
    items = sorted(
        ((counts[e] / replicas[e], e) for e in range(len(counts)) for _ in range(replicas[e])),
        key=lambda item: (-item[0], item[1]),
    )
    bins: list[list[int]] = [[] for _ in range(world)]
    loads = [0.0] * world
    for load, e in items:
        free = [r for r in range(world) if len(bins[r]) < per_rank]
        fresh = [r for r in free if e not in bins[r]] or free
        rank = min(fresh, key=lambda r: (loads[r], r))
        bins[rank].append(e)
        loads[rank] += load
    return bins


def _keep_in_place(
    bins: list[list[int]], current: Placement, world: int, per_rank: int
) -> Placement:
    """Give each packed bin to the rank that already holds most of its experts, and each
    expert the slot it already has on that rank: the balance is the same, the copies fewer."""
    held = [current[r * per_rank : (r + 1) * per_rank] for r in range(world)]
    free_ranks = list(range(world))
    order = sorted(
        range(world), key=lambda b: -max(_overlap(bins[b], held[r]) for r in range(world))
    )
    slots: Placement = [0] * len(current)
    for b in order:
        rank = max(free_ranks, key=lambda r: (_overlap(bins[b], held[r]), -r))
        free_ranks.remove(rank)
        slots[rank * per_rank : (rank + 1) * per_rank] = _arrange(bins[b], held[rank])
    return slots


def _overlap(a: list[int], b: list[int]) -> int:
    rest = list(b)
    n = 0
    for e in a:
        if e in rest:
            rest.remove(e)
            n += 1
    return n


def _arrange(experts: list[int], old: list[int]) -> list[int]:
    """`experts` in slot order, each one the rank already holds kept in its old slot."""
    slots: list[int | None] = [None] * len(old)
    rest = list(experts)
    for i, e in enumerate(old):
        if e in rest:
            slots[i] = e
            rest.remove(e)
    for i in range(len(slots)):
        if slots[i] is None:
            slots[i] = rest.pop(0)
    return [e for e in slots if e is not None]
