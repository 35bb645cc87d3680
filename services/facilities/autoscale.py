"""Desired replica counts for an orchestrator: the autoscaler's policy on the racks this
service watches, published for KEDA (scaler.py) and for compose (GET /v1/autoscale/desired).

Under compose or Kubernetes nothing here starts or stops a worker: the orchestrator owns
the processes, and this service says how many of each pool should run. Every `interval_s`:

    heartbeats (live workers, busy share, queue) + racks (cap, latest power, free nodes)
        --> autoscale.policy.decide --> desired[role] --> the scaler and the HTTP route

A start the orchestrator has not made yet (its pod is pulling, loading the model) shows as
a starting worker for `start_grace_s`, so the next decision does not ask for it again.
Which worker stops on a scale-down is the orchestrator's choice (it sends SIGTERM: the
worker's graceful stop drains it); the policy's pick is only advice.

Workers the inventory places sit on their racks; others (pod names the inventory does not
list) on one rack, `unplaced`, of unbounded power. In `sla` mode new workers may go there
(up to the pool's maximum); in `power` mode a start needs an inventory node whose rack has
budget for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

from tokenyard.autoscale.policy import (
    ROLES,
    AutoscaleSettings,
    Decision,
    RackSignal,
    ScalerState,
    Signals,
    WorkerSignal,
    decide,
)
from tokenyard.facilities.inventory import Inventory
from tokenyard.fleet import FleetView
from tokenyard.services.facilities.monitor import RackMonitor
from tokenyard.services.facilities.settings import FacilitiesSettings

log = logging.getLogger(__name__)

UNPLACED = "unplaced"


def advisor_settings(settings: FacilitiesSettings, inventory: Inventory) -> AutoscaleSettings:
    """The policy's settings from the service's; a worker draws its node's accelerators at
    full load (the inventory's largest node: a budget errs high)."""
    assert settings.autoscale_mode != "off"
    node_kw = max(
        (n.gpus * n.gpu_tdp_w / 1000 for r in inventory.racks for n in r.nodes), default=1.0
    )
    return AutoscaleSettings(
        mode=settings.autoscale_mode,
        ttft_p99_s=settings.autoscale_ttft_p99_s,
        itl_p99_s=settings.autoscale_itl_p99_s,
        min_workers={
            "prefill": settings.autoscale_min_prefill,
            "decode": settings.autoscale_min_decode,
        },
        max_workers={
            "prefill": settings.autoscale_max_prefill,
            "decode": settings.autoscale_max_decode,
        },
        worker_full_kw={"prefill": node_kw, "decode": node_kw},
    )


@dataclass
class Desired:
    """The latest decision, as the orchestrator reads it."""

    counts: dict[str, int]
    live: dict[str, int]
    reasons: tuple[str, ...] = ()
    blocked: int = 0
    at: float = 0.0  # unix seconds of the decision
    pending_until: dict[str, float] = field(default_factory=dict)  # starts not yet heard from


class ReplicaAdvisor:
    def __init__(
        self,
        monitor: RackMonitor,
        settings: AutoscaleSettings,
        interval_s: float = 5.0,
        start_grace_s: float = 180.0,
    ) -> None:
        self.monitor = monitor
        self.settings = settings
        self.interval_s = interval_s
        self.start_grace_s = start_grace_s
        self.state = ScalerState()
        self.desired = Desired(
            counts={r: settings.min_workers.get(r, 1) for r in ROLES},
            live={r: 0 for r in ROLES},
        )
        self._next_at = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                decision = self.tick()
                if decision is not None and decision.reasons:
                    log.info("autoscale: %s", "; ".join(decision.reasons))
            except Exception:
                # NOTE: a failed decision must not end the service; the next tick retries.
                log.exception("autoscale decision failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    def count(self, role: str) -> int:
        return self.desired.counts.get(role, 0)

    def tick(self, now: float | None = None) -> Decision | None:
        """Every interval: decide on what the heartbeats and the racks say now."""
        now = self.monitor.clock() if now is None else now
        if now < self._next_at:
            return None
        self._next_at = now + self.interval_s
        signals = self.signals(now)
        decision = decide(signals, self.state, self.settings)
        live = {r: sum(w.role == r for w in self._live(now)) for r in ROLES}
        pending = dict(self.desired.pending_until)
        for start in decision.start:
            pending[start.role] = now + self.start_grace_s
        reasons = decision.reasons or self.desired.reasons  # why the counts last changed
        self.desired = Desired(
            dict(decision.desired), live, reasons, decision.blocked, time.time(), pending
        )
        return decision

    def _live(self, now: float) -> list[WorkerSignal]:
        fleet: FleetView = self.monitor.fleet
        placed = self.monitor.worker_rack
        out = []
        for view in fleet.live(now):
            hb = view.heartbeat
            if hb.role not in ROLES:
                continue  # an aggregated worker ("both") is in no pool this scales
            seqs = hb.max_num_seqs or 1
            out.append(
                WorkerSignal(
                    hb.worker_id,
                    hb.role,
                    placed.get(hb.worker_id, UNPLACED),
                    busy=hb.num_running / seqs,
                    queued=hb.num_waiting,
                    max_num_seqs=seqs,
                    starting=bool(hb.not_ready),
                    draining=hb.draining,
                )
            )
        return out

    def signals(self, now: float) -> Signals:
        workers = self._live(now)
        workers += self._pending(workers, now)
        live_ids = {w.worker_id for w in workers}
        racks = [self._rack(name, live_ids) for name in self.monitor.racks]
        if self.settings.mode == "sla":
            room = sum(self.settings.max_workers.get(r, 0) for r in ROLES) - len(workers)
            slots = tuple(f"{UNPLACED}-{i}" for i in range(max(0, min(room, 1000))))
        else:
            slots = ()
        racks.append(RackSignal(UNPLACED, math.inf, 0.0, slots))
        return Signals(now, tuple(workers), tuple(racks))

    def _pending(self, live: list[WorkerSignal], now: float) -> list[WorkerSignal]:
        """Starts asked for and not yet heard from, as starting workers (until the grace)."""
        out = []
        for role, until in self.desired.pending_until.items():
            if now >= until:
                continue
            serving = sum(1 for w in live if w.role == role and not w.draining)
            for i in range(max(0, self.desired.counts.get(role, 0) - serving)):
                out.append(WorkerSignal(f"pending-{role}-{i}", role, UNPLACED, 0.0, 0, 1, True))
        return out

    def _rack(self, name: str, live_ids: set[str]) -> RackSignal:
        rt = self.monitor.racks[name]
        cap = rt.limits.power_cap_kw or math.inf
        power = rt.latest.power_kw if rt.latest is not None else 0.0
        free = tuple(
            node.name for node in rt.spec.nodes if not any(w in live_ids for w in node.workers)
        )
        return RackSignal(name, cap, power, free)

    def as_json(self) -> dict:
        d = self.desired
        return {
            "mode": self.settings.mode,
            "desired": d.counts,
            "live": d.live,
            "min_workers": dict(self.settings.min_workers),
            "max_workers": dict(self.settings.max_workers),
            "reasons": list(d.reasons),
            "blocked_starts": d.blocked,
            "decided_at": d.at or None,
            "interval_s": self.interval_s,
        }
