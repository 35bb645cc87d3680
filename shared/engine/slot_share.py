"""Each tenant's share of a worker's running slots: the fair policy at the batch, beside the
fair order of its waiting queue (engine/fair_queue.py).

A fair queue alone lets a quiet tenant's request go first, but only into a free slot: while
a noisy tenant holds every slot it waits for one of them to end. So within one priority
class the `max_num_seqs` slots are shared equally between the tenants that run or wait in
it (llm-d's flow control, vLLM's priority scheduling):

- hold back: a tenant at or over its share is not admitted while a tenant under its share
  waits in the same class (a free slot is kept for the one under its share);
- preempt: a tenant under its share that finds no slot (or no blocks) takes one from the
  tenant most over its share in its class (its most recently admitted sequence, recomputed
  later), as long as that tenant still holds at least as many slots as it after the swap (so two tenants never take a slot back and forth, and one
  slot is never passed around: with one slot, nothing is preempted for fairness).

With nobody under its share waiting, one tenant may hold every slot (work-conserving).

    shares = SlotShares.of(running, waiting, max_num_seqs)   # (priority, tenant) pairs
    shares.under(0, "quiet")              # holds fewer slots than its share now
    shares.victim(0, "quiet")             # whose slot it may take, or None
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

Who = tuple[int, str]  # (priority, tenant)


@dataclass
class SlotShares:
    max_num_seqs: int
    held: Counter[Who] = field(default_factory=Counter)  # running sequences
    waiting: Counter[Who] = field(default_factory=Counter)  # waiting sequences
    tenants: dict[int, set[str]] = field(default_factory=dict)  # class -> its active tenants

    @classmethod
    def of(cls, running: Iterable[Who], waiting: Iterable[Who], max_num_seqs: int) -> SlotShares:
        shares = cls(max_num_seqs, Counter(running), Counter(waiting))
        for priority, tenant in (*shares.held, *shares.waiting):
            shares.tenants.setdefault(priority, set()).add(tenant)
        return shares

    def share(self, priority: int) -> float:
        """The slots each tenant of this class may hold while another one waits."""
        return self.max_num_seqs / max(1, len(self.tenants.get(priority, ())))

    def under(self, priority: int, tenant: str) -> bool:
        return self.held[priority, tenant] < self.share(priority)

    def held_back(self, priority: int, tenant: str) -> bool:
        """True when `tenant` is at or over its share and another tenant of the class, under
        its share, waits: the next free slot is that one's."""
        if self.under(priority, tenant):
            return False
        return any(
            other != tenant and self.waiting[priority, other] and self.under(priority, other)
            for other in self.tenants.get(priority, ())
        )

    def victim(self, priority: int, tenant: str) -> str | None:
        """The tenant of the class most over its share (ties: the first by name) whose
        running sequence `tenant` may preempt; None when none is over its share and holds
        two more than `tenant`."""
        mine, share = self.held[priority, tenant], self.share(priority)
        others = [
            (-held, other)
            for other in self.tenants.get(priority, ())
            if other != tenant
            and (held := self.held[priority, other]) > share
            and held - 1 >= mine + 1
        ]
        return min(others)[1] if others else None

    def admit(self, priority: int, tenant: str) -> None:
        self.held[priority, tenant] += 1
        self.waiting[priority, tenant] -= 1

    def preempt(self, priority: int, tenant: str) -> None:
        self.held[priority, tenant] -= 1
        self.waiting[priority, tenant] += 1
