"""Which offered blocks the sender keeps for which request, and until when.

Pure bookkeeping with an injectable clock, so the expiry rules are unit-tested without
sleeping. The server turns every hold that ends (release, abort, expiry) into exactly one
``on_release(request_id)`` call: blocks are never leaked and never freed twice.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Hold:
    block_ids: frozenset[int]
    expires_at: float


class HoldTable:
    def __init__(self, hold_timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.hold_timeout_s = hold_timeout_s
        self._clock = clock
        self._holds: dict[str, Hold] = {}
        # offer() comes from the engine's thread, the rest from the gRPC event loop.
        self._lock = threading.Lock()

    def offer(self, request_id: str, block_ids: Sequence[int]) -> None:
        with self._lock:
            if request_id in self._holds:
                raise ValueError(f"request {request_id!r} already has offered KV blocks")
            self._holds[request_id] = Hold(
                frozenset(block_ids), self._clock() + self.hold_timeout_s
            )

    def check(self, request_id: str, block_ids: Sequence[int]) -> str | None:
        """Why these blocks cannot be read for this request, or None (and the hold is
        extended: a receiver that is working on it gets a full timeout again)."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None:
                return f"no KV blocks offered for request {request_id!r} (released or expired)"
            stray = sorted(set(block_ids) - hold.block_ids)
            if stray:
                return f"blocks {stray[:8]} were not offered for request {request_id!r}"
            hold.expires_at = self._clock() + self.hold_timeout_s
            return None

    def expires_in(self, request_id: str) -> float:
        with self._lock:
            hold = self._holds.get(request_id)
            return 0.0 if hold is None else max(0.0, hold.expires_at - self._clock())

    def end(self, request_id: str) -> bool:
        """Drop a hold; True if it was still there (the caller then frees its blocks)."""
        with self._lock:
            return self._holds.pop(request_id, None) is not None

    def expired(self) -> list[str]:
        """Drop and return every hold past its deadline."""
        now = self._clock()
        with self._lock:
            gone = [rid for rid, h in self._holds.items() if h.expires_at <= now]
            for rid in gone:
                del self._holds[rid]
            return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)
