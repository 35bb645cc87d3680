"""The worker's own cap on concurrently admitted sequences (the facilities derate/drain).

The router already places less on a derated rack, but jobs it sent earlier, hand-offs from
other workers and redeliveries still arrive; the worker is what actually holds the line.
A request over the cap is not refused: it waits here, in the worker's queue, until a
running one ends or the cap rises; waiters go in by priority and fair share, as in the
engine's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from tokenyard.engine.fair_queue import FairQueue, Policy, QueueKey
from tokenyard.facilities.tracker import RackStateTracker
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1.facilities_pb2 import RackState

# The cap can also change without a wake-up (a facilities state going stale): re-check.
RECHECK_S = 0.5


@dataclass(eq=False)
class _Waiter:
    key: QueueKey
    cost: int  # tokens it may be served: its fair share's charge when it is let in
    granted: asyncio.Future[None]


class AdmissionGate:
    """Waiters are let in by priority, then a fair share between tenants, then arrival
    (engine/fair_queue.py), whenever the cap leaves room."""

    def __init__(self, cap: Callable[[], int], policy: Policy = "fair") -> None:
        self._cap = cap  # 0 = no cap
        self.admitted = 0
        self._queue: FairQueue[_Waiter] = FairQueue(lambda w: w.key, lambda w: w.cost, policy)
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def has_room(self) -> bool:
        cap = self._cap()
        return cap <= 0 or self.admitted < cap

    async def acquire(self, priority: int = 0, tenant: str = "", cost: int = 0) -> None:
        granted = asyncio.get_running_loop().create_future()
        waiter = _Waiter(QueueKey(priority, tenant, next(self._arrivals)), cost, granted)
        self._queue.push(waiter)
        self._let_in()
        try:
            while not granted.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(granted), RECHECK_S)
                self._let_in()
        except BaseException:
            if granted.done():
                self.release()  # let in just as it was cancelled: the place goes back
            else:
                self._queue.remove(waiter)
            raise

    def release(self) -> None:
        self.admitted -= 1
        self.wake()

    def wake(self) -> None:
        """Something changed (a sequence ended, a new rack state): waiters look again."""
        self._let_in()

    def _let_in(self) -> None:
        for waiter in self._queue.ordered():
            if not self.has_room():
                break
            self._queue.remove(waiter)
            self._queue.charge(waiter.key.tenant, waiter.cost)
            self.admitted += 1
            waiter.granted.set_result(None)


class RackCap:
    """The facilities service's word on this worker's rack, as a cap on its sequences."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.facilities = RackStateTracker()

    def apply(self, msg: RackState) -> None:
        self.facilities.apply(msg)

    def seq_cap(self) -> int:
        """How many sequences may run here at once now; 0 = no cap beyond max_num_seqs."""
        throttle = self.facilities.state_for_worker(self.settings.worker_id)
        if throttle.state == "drain":
            # The router sends nothing new; what it already sent must still end, one by one.
            return 1
        if throttle.state == "derate":
            most = self.settings.max_num_seqs
            return min(throttle.seq_cap or most, most)
        return 0
