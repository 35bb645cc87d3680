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
