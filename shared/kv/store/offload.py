"""What a worker sends to the KV-cache service, and how much: pure bookkeeping, no I/O.

- :class:`BandwidthBudget`: a token bucket in bytes. An offload takes as many *leading*
  blocks as the bucket holds (a prefix hit needs every block before it, so a tail is worth
  nothing without its head) and the rest is dropped and counted: the service and the
  worker's network are never asked for more than ``bytes_per_s`` on average.
- :class:`RecentHashes`: the hashes this worker sent (or fetched) lately, so a block that
  every request shares (a system prompt) is not uploaded again with every request. It only
  saves bandwidth: a hash that fell out of it is sent again, and the service keeps one copy.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable


class BandwidthBudget:
    """A token bucket of ``bytes_per_s``, holding at most ``burst_s`` seconds of it.

    ``bytes_per_s <= 0`` means no limit."""

    def __init__(
        self,
        bytes_per_s: float,
        burst_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bytes_per_s = bytes_per_s
        self.capacity = bytes_per_s * burst_s
        self.clock = clock
        self._level = self.capacity
        self._at = clock()

    @property
    def unlimited(self) -> bool:
        return self.bytes_per_s <= 0

    def _refill(self) -> None:
        now = self.clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.bytes_per_s)
        self._at = now

    def take_blocks(self, num_blocks: int, block_bytes: int) -> int:
        """Spend the budget on up to ``num_blocks`` blocks; returns how many it covers."""
        if self.unlimited or num_blocks <= 0:
            return max(0, num_blocks)
        self._refill()
        n = min(num_blocks, int(self._level // block_bytes)) if block_bytes > 0 else num_blocks
        self._level -= n * block_bytes
        return n

    def give_back(self, num_bytes: int) -> None:
        """Return bytes taken for blocks that were not sent after all."""
        if not self.unlimited:
            self._level = min(self.capacity, self._level + num_bytes)


class RecentHashes:
    """An LRU set of at most ``capacity`` block hashes, each forgotten ``ttl_s`` after it
    was last added (the service may have evicted it since: then it is sent again)."""

    def __init__(
        self, capacity: int, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.clock = clock
        self._seen: OrderedDict[int, float] = OrderedDict()  # hash -> when added, oldest first

    def __contains__(self, h: int) -> bool:
        at = self._seen.get(h)
        return at is not None and self.clock() - at < self.ttl_s

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, hashes: Iterable[int]) -> None:
        now = self.clock()
        for h in hashes:
            self._seen[h] = now
            self._seen.move_to_end(h)
        while self._seen and (
            len(self._seen) > self.capacity or now - next(iter(self._seen.values())) >= self.ttl_s
        ):
            self._seen.popitem(last=False)

    def unsent(self, hashes: list[int]) -> list[int]:
        """``hashes`` from the first one not known to be in the service on.

        Everything before it is in the service already (sent or fetched); a chain's later
        blocks are sent even if some were sent before, so the prefix stays whole."""
        for i, h in enumerate(hashes):
            if h not in self:
                return hashes[i:]
        return []
