"""The router's global prefix index: which worker caches which block, fed by KV events."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.v1 import serving_pb2 as pb


class BlockIndex:
    """Global prefix index: block hash -> workers holding it, fed by KV events."""

    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = defaultdict(set)
        self._by_worker: dict[str, set[int]] = defaultdict(set)

    def on_event(self, event: pb.KVEvent) -> None:
        if event.hash_version and event.hash_version != HASH_SPEC_VERSION:
            return  # another hash scheme: its hashes mean nothing to us
        worker = event.worker_id
        if event.kind == pb.KVEvent.CLEARED:
            self.forget(worker)
        elif event.kind == pb.KVEvent.STORED:
            for h in event.block_hashes:
                self._holders[h].add(worker)
                self._by_worker[worker].add(h)
        elif event.kind == pb.KVEvent.REMOVED:
            for h in event.block_hashes:
                self._drop(h, worker)

    def replace(self, worker: str, block_hashes: Sequence[int]) -> None:
        """The worker holds exactly these blocks now (a resync's dump)."""
        self.forget(worker)
        for h in block_hashes:
            self._holders[h].add(worker)
            self._by_worker[worker].add(h)

    def blocks_of(self, worker: str) -> set[int]:
        return set(self._by_worker.get(worker, ()))

    def forget(self, worker: str) -> None:
        for h in self._by_worker.pop(worker, set()):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def _drop(self, h: int, worker: str) -> None:
        self._by_worker[worker].discard(h)
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]

    def overlap(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many *leading* blocks of the prompt it holds (a prefix hit needs
        every block before it, so the count stops at the first missing block)."""
        counts: dict[str, int] = {}
        candidates: set[str] | None = None
        for i, h in enumerate(block_hashes):
            holders = self._holders.get(h, set())
            candidates = set(holders) if candidates is None else candidates & holders
            if not candidates:
                break
            for worker in candidates:
                counts[worker] = i + 1
        return counts

    def __len__(self) -> int:
        return len(self._holders)
