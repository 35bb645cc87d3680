"""Who goes next among waiting requests: priority class first, then a fair share of tokens
between tenants, then arrival. One home for that order: the engine's waiting queue
(engine/scheduler.py) and the worker's admission gate (services/worker/admission.py) both
keep their waiters in a :class:`FairQueue`.

Three policies:

- ``fcfs``: arrival order; `priority` is ignored (the order before priorities existed).
- ``priority``: lower `priority` first (vLLM's convention: a lower value is more urgent),
  then arrival.
- ``fair`` (the default): priority first; within one priority, start-time fair queueing
  over tokens between tenants, each of weight 1. Each tenant has a virtual time, the tokens
  it was served (``charge``); the waiting request of the tenant with the lowest one goes
  next. A tenant that starts waiting is lifted to the virtual time of those already
  waiting, so idle time is no credit: a noisy tenant sending ten times the load of a quiet
  one gets the same share of tokens while both wait, and all of it while the quiet one has
  nothing queued.

    queue = FairQueue[Seq](key=lambda s: QueueKey(s.priority, s.tenant, s.arrival), cost=...)
    queue.push(seq)
    for seq in queue.ordered():     # the order to admit in, computed now
        ...
    queue.charge("tenant-a", 128)   # tokens it was served (a step's prefill chunk, a decode)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar, get_args

Policy = Literal["fcfs", "priority", "fair"]
POLICIES: tuple[Policy, ...] = get_args(Policy)

# The bounds of a request's `priority` (the gateway refuses others with a 400); 0 = normal.
PRIORITY_MIN, PRIORITY_MAX = -100, 100

T = TypeVar("T")


@dataclass(frozen=True)
class QueueKey:
    priority: int  # lower = more urgent
    tenant: str  # who the fair share charges ("" = the anonymous tenant)
    arrival: int  # order of arrival (a preempted request keeps its own)


def check_policy(policy: str) -> Policy:
    if policy not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
    return policy  # type: ignore[return-value]


def check_priority(priority: int) -> int:
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority}")
    return priority


class FairQueue(Generic[T]):
    def __init__(
        self,
        key: Callable[[T], QueueKey],
        cost: Callable[[T], int],
        policy: Policy = "fair",
    ) -> None:
        """`key`: an item's class, tenant and arrival; `cost`: the tokens it will be served
        (what ordering several items of one tenant charges ahead of time)."""
        self.policy = check_policy(policy)
        self._key = key
        self._cost = cost
        self._items: list[T] = []  # arrival order, preempted items put back in front
        self._served: dict[str, int] = {}  # tenant -> virtual time (tokens served)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator[T]:
        """The items in no promised order (sums, counts); :meth:`ordered` is the order."""
        return iter(self._items)

    def push(self, item: T, *, front: bool = False) -> None:
        """Queue `item`; `front`: a preempted item, ahead of its equals under fcfs."""
        tenant = self._key(item).tenant
        if not any(self._key(other).tenant == tenant for other in self._items):
            self._served[tenant] = max(self._served.get(tenant, 0), self._floor())
        if front:
            self._items.insert(0, item)
        else:
            self._items.append(item)

    def remove(self, item: T) -> None:
        self._items.remove(item)

    def charge(self, tenant: str, tokens: int) -> None:
        """`tenant` was served `tokens` (computed, or admitted to be computed)."""
        self._served[tenant] = self._served.get(tenant, 0) + tokens

    def served(self, tenant: str) -> int:
        return self._served.get(tenant, 0)

    def waiting_by_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for item in self._items:
            tenant = self._key(item).tenant
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    def ordered(self) -> list[T]:
        """The items in the order they should be admitted, as things stand now."""
        if self.policy == "fcfs":
            return list(self._items)
        by_class: dict[int, list[T]] = {}
        for item in self._items:  # NOTE: stable: equal items keep their queue order
            by_class.setdefault(self._key(item).priority, []).append(item)
        out: list[T] = []
        for priority in sorted(by_class):
            items = by_class[priority]
            out.extend(items if self.policy == "priority" else self._interleave(items))
        return out

    def _interleave(self, items: list[T]) -> list[T]:
        """One class's items, tenants taking turns by virtual time (ties: the earlier item)."""
        per_tenant: dict[str, list[T]] = {}
        for item in items:
            per_tenant.setdefault(self._key(item).tenant, []).append(item)
        # heap of (virtual time, position of the tenant's next item in `items`, tenant, index)
        position = {id(item): i for i, item in enumerate(items)}
        heap = [(self.served(t), position[id(q[0])], t, 0) for t, q in per_tenant.items()]
        heapq.heapify(heap)
        out: list[T] = []
        while heap:
            vtime, _, tenant, i = heapq.heappop(heap)
            queue = per_tenant[tenant]
            out.append(queue[i])
            if i + 1 < len(queue):
                nxt = queue[i + 1]
                heapq.heappush(
                    heap, (vtime + self._cost(queue[i]), position[id(nxt)], tenant, i + 1)
                )
        return out

    def _floor(self) -> int:
        """The virtual time a tenant starts waiting at: that of the tenants waiting now (the
        least of them), or with none waiting the most any tenant was served."""
        waiting = {self._key(item).tenant for item in self._items}
        if waiting:
            return min(self._served.get(t, 0) for t in waiting)
        return max(self._served.values(), default=0)
