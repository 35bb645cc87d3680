"""What the router knows about the fleet: live workers (heartbeats) and who caches which block."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.services.router.policy import WorkerView
from tokenyard.v1 import serving_pb2 as pb


class WorkerTable:
    """The latest heartbeat of every worker, as WorkerViews for the policy."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerView] = {}

    def on_heartbeat(self, hb: pb.WorkerHeartbeat, now: float) -> None:
        self.workers[hb.worker_id] = WorkerView(
            worker_id=hb.worker_id,
            role=hb.role,
            model=hb.model,
            last_seen=now,
            heartbeat_interval_s=(hb.heartbeat_interval_ms or 1000) / 1000,
            num_running=hb.num_running,
            num_waiting=hb.num_waiting,
            num_free_blocks=hb.num_free_blocks,
            num_blocks=hb.num_blocks,
            max_num_seqs=hb.max_num_seqs or 1,
            seq_cap=hb.seq_cap,
            block_size=hb.block_size or 16,
            pending=0,  # the beat already counts what we placed before it
        )

    def placed(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            self.workers[worker_id] = dataclasses.replace(w, pending=w.pending + 1)

    def forget_dead(self, now: float, missed_heartbeats: int, grace: float = 10.0) -> list[str]:
        """Drop workers silent for well past their death; returns their ids."""
        dead = [
            w.worker_id
            for w in self.workers.values()
            if now - w.last_seen > missed_heartbeats * w.heartbeat_interval_s + grace
        ]
        for worker_id in dead:
            del self.workers[worker_id]
        return dead


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
