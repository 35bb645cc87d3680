"""The worker's own cap on concurrently admitted sequences (the facilities derate/drain).

The router already places less on a derated rack, but jobs it sent earlier, hand-offs from
other workers and redeliveries still arrive; the worker is what actually holds the line.
A request over the cap is not refused: it waits here, in the worker's queue, until a
running one ends or the cap rises.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from tokenyard.facilities.tracker import RackStateTracker
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1.facilities_pb2 import RackState

# The cap can also change without a wake-up (a facilities state going stale): re-check.
RECHECK_S = 0.5


class AdmissionGate:
    def __init__(self, cap: Callable[[], int]) -> None:
        self._cap = cap  # 0 = no cap
        self.admitted = 0
        self.waiting = 0
        self._changed = asyncio.Event()

    def has_room(self) -> bool:
        cap = self._cap()
        return cap <= 0 or self.admitted < cap

    async def acquire(self) -> None:
        self.waiting += 1
        try:
            while not self.has_room():
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), RECHECK_S)
        finally:
            self.waiting -= 1
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1
        self.wake()

    def wake(self) -> None:
        """Something changed (a sequence ended, a new rack state): waiters look again."""
        self._changed.set()


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
