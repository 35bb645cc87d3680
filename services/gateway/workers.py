"""The workers the gateway has heard from, from their heartbeats (for /ready and dead-worker checks).

Pure state with an explicit clock: the bus handler feeds heartbeats in, tests feed them too.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenyard.v1 import serving_pb2 as pb

# Which heartbeat roles can do which part of a request.
CAN_PREFILL = ("prefill", "both")
CAN_DECODE = ("decode", "both")
DEFAULT_INTERVAL_S = 1.0


@dataclass
class Seen:
    heartbeat: pb.WorkerHeartbeat
    at: float  # monotonic seconds

    @property
    def interval_s(self) -> float:
        ms = self.heartbeat.heartbeat_interval_ms
        return ms / 1000 if ms else DEFAULT_INTERVAL_S


class WorkerTable:
    def __init__(self, missed_heartbeats: int = 3) -> None:
        self.missed = missed_heartbeats
        self._seen: dict[str, Seen] = {}

    def on_heartbeat(self, hb: pb.WorkerHeartbeat, now: float) -> None:
        self._seen[hb.worker_id] = Seen(hb, now)

    def _alive(self, seen: Seen, now: float) -> bool:
        return now - seen.at <= self.missed * seen.interval_s

    def live(self, now: float) -> list[Seen]:
        return [s for s in self._seen.values() if self._alive(s, now)]

    def is_dead(self, worker_id: str, now: float) -> bool:
        """True only for a worker seen once and silent since; an unknown worker is not dead."""
        seen = self._seen.get(worker_id)
        return seen is not None and not self._alive(seen, now)

    def roles(self, now: float) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.live(now):
            counts[s.heartbeat.role] = counts.get(s.heartbeat.role, 0) + 1
        return counts

    def missing_role(self, now: float) -> str | None:
        """The first part of a request no live worker can do, or None when all can be served."""
        roles = self.roles(now)
        for name, able in (("prefill", CAN_PREFILL), ("decode", CAN_DECODE)):
            if not any(roles.get(r) for r in able):
                return name
        return None

    def max_model_len(self, now: float) -> int:
        """The smallest context any live worker serves (0 = unknown)."""
        lens = [s.heartbeat.max_model_len for s in self.live(now) if s.heartbeat.max_model_len]
        return min(lens) if lens else 0

    def models(self, now: float) -> set[str]:
        return {s.heartbeat.model for s in self.live(now) if s.heartbeat.model}
