"""The router's view of the facilities service: the latest RackState per rack, per worker.

    tracker = RackStateTracker()
    await tracker.start(bus)                       # subscribes to ty.facilities.state.*
    tracker.state_for_worker("decode-0")           # -> WorkerThrottle(state="derate", seq_cap=4, ...)

Staleness: a RackState older than `stale_after_s` (default: three of its publisher's
heartbeats, at least 15 s) is no longer trusted as it stands. A stale drain or derate
becomes a derate (the rack may still be hurt, but a dead facilities service must not
take the fleet down), capped at one sequence per worker; a stale derate keeps its cap;
a stale normal stays normal.

Headroom: besides its state, each RackState says how close the rack's power is to its
derate threshold (`power_pressure`, 0..1). A fresh one makes the load of the rack's workers
count `1 + headroom_gain x pressure` times in placement, so new work spreads over the racks
in proportion to their room before any rack has to derate (and so before a derate's halved
caps push work onto its neighbours). NOTE: a weight on load, not a fixed penalty: a fixed
penalty, stale for a whole heartbeat, sends every new request to the coolest rack until the
next reading (a herd); a weight shares the work out, since a worker's load grows with every
placement the router makes on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.msg import Msg

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.facilities.messages import PROTO_TO_STATE
from tokenyard.facilities.policy import State, StateName
from tokenyard.v1.facilities_pb2 import RackState


@dataclass(frozen=True)
class WorkerThrottle:
    """One worker's rack as the facilities service sees it: the router's placement input
    (`tokenyard.routing.policy.choose`)."""

    state: StateName = "normal"
    seq_cap: int = 0  # derate: at most this many concurrent sequences per worker; 0 = no cap
    retry_after_s: int = 0  # drain: when a client might try again
    # Derate: subtracted from the placement score, so among equals the healthy rack's worker
    # wins even before the derated one fills up (in units of a full worker, like busy).
    cost_penalty: float = 0.0
    # Near its power cap (the facilities' power_pressure): the worker's load counts this
    # many times, so new work spreads over the racks in proportion to their headroom.
    load_weight: float = 1.0
    rack: str | None = None  # None: the worker is on no rack the facilities service knows
    reason: str = ""


UNKNOWN = WorkerThrottle(reason="no facilities state for this worker")


class RackStateTracker:
    def __init__(
        self,
        *,
        stale_after_s: float | None = None,
        derate_penalty: float = 0.5,
        headroom_gain: float = 20.0,
        drain_retry_after_s: int = 30,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.derate_penalty = derate_penalty
        self.headroom_gain = headroom_gain
        self.drain_retry_after_s = drain_retry_after_s
        self.clock = clock
        self.racks: dict[str, RackState] = {}
        self.worker_rack: dict[str, str] = {}

    async def start(self, bus: Bus) -> None:
        await bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, self.on_state)

    async def on_state(self, msg: RackState, _raw: Msg) -> None:
        self.apply(msg)

    def apply(self, msg: RackState) -> None:
        old = self.racks.get(msg.rack)
        if old is not None and msg.sent_unix_s < old.sent_unix_s:
            return  # out of order: keep the newer one
        self.racks[msg.rack] = msg
        for worker in msg.worker_ids:
            self.worker_rack[worker] = msg.rack

    def state_for_worker(self, worker_id: str, now: float | None = None) -> WorkerThrottle:
        rack = self.worker_rack.get(worker_id)
        msg = self.racks.get(rack) if rack is not None else None
        if msg is None:
            return UNKNOWN
        return self._throttle(msg, self.clock() if now is None else now)

    def by_worker(self, now: float | None = None) -> dict[str, WorkerThrottle]:
        """Every known worker's throttle: the router's per-request input."""
        now = self.clock() if now is None else now
        throttles = {name: self._throttle(msg, now) for name, msg in self.racks.items()}
        return {worker: throttles[rack] for worker, rack in self.worker_rack.items()}

    def _throttle(self, msg: RackState, now: float) -> WorkerThrottle:
        state = PROTO_TO_STATE.get(msg.state, State.NORMAL)
        reason = msg.reason
        age = now - msg.sent_unix_s
        limit = self.stale_after_s or max(15.0, 3 * msg.heartbeat_s)
        if age > limit and state is State.DRAIN:
            state, reason = (
                State.DERATE,
                f"stale facilities state ({age:.0f} s old); was drain: {reason}",
            )
        # NOTE: a stale drain carries no derated cap; one sequence per worker is the cautious one.
        seq_cap = max(1, msg.max_seqs_per_worker) if state is State.DERATE else 0
        # An old reading's headroom says nothing about now.
        pressure = msg.power_pressure if age <= limit else 0.0
        return WorkerThrottle(
            rack=msg.rack,
            state=state.label,
            seq_cap=seq_cap,
            cost_penalty=self.derate_penalty if state is State.DERATE else 0.0,
            load_weight=1.0 + self.headroom_gain * pressure,
            retry_after_s=self.drain_retry_after_s if state is State.DRAIN else 0,
            reason=reason,
        )
