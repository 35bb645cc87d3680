"""The autoscaler in the fleet simulator: `autoscale.policy.decide` run against simulated
workers, exactly as a service runs it against live ones.

Every node of the fleet is a slot (`FleetSpec.slots`): off until the autoscaler starts a
worker there with a role. A started worker serves after `start_s` (its model loading) and
draws idle power meanwhile; a drained one announces `draining`, so the router places nothing
new on it, finishes what it holds, and then switches its node off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenyard.autoscale.policy import (
    AutoscaleSettings,
    Decision,
    RackSignal,
    ScalerState,
    Signals,
    WorkerSignal,
    decide,
    place,
)
from tokenyard.stats import percentile

if TYPE_CHECKING:
    from tokenyard.facilities.inventory import NodeSpec
    from tokenyard.sim.fleet import SimWorker
    from tokenyard.sim.simulator import SimConfig, Simulation


@dataclass(frozen=True)
class SimScaling:
    interval_s: float = 2.0  # between decisions
    start_s: float = 5.0  # from the start to serving (loading the model)
    initial: tuple[int, int] = (1, 1)  # prefill and decode workers serving at time 0


class SimAutoscaler:
    def __init__(self, settings: AutoscaleSettings, scaling: SimScaling) -> None:
        self.settings = settings
        self.scaling = scaling
        self.state = ScalerState()
        self.next_at = 0.0
        self.timeline: list[tuple[float, int, int]] = []
        self.blocked = 0  # starts the power budget refused
        self.started = 0
        self.drained = 0

    def tick(self, sim: Simulation) -> None:
        if not self.timeline:
            self._start_initial(sim)
        interval_ms = int(sim.cfg.heartbeat_s * 1000)
        for w in sim.workers.values():
            if w.power == "starting" and sim.now >= w.ready_s:
                w.power = "on"
                sim.fleet.on_heartbeat(w.heartbeat(interval_ms), sim.now)
        if sim.now < self.next_at:
            return
        self.next_at = sim.now + self.scaling.interval_s
        decision = decide(self.signals(sim), self.state, self.settings)
        self.apply(sim, decision)
        counts = {"prefill": 0, "decode": 0}
        for w in sim.workers.values():
            if w.power in ("starting", "on"):
                counts[w.role] += 1
        self.timeline.append((round(sim.now, 3), counts["prefill"], counts["decode"]))

    def _start_initial(self, sim: Simulation) -> None:
        """The fleet the day begins with, placed as the mode places, serving at once."""
        prefill, decode = self.scaling.initial
        starts, _ = place(["prefill"] * prefill + ["decode"] * decode, self.signals(sim),
                          self.settings)  # fmt: skip
        interval_ms = int(sim.cfg.heartbeat_s * 1000)
        for start in starts:
            w = sim.workers[start.node]
            self._start(sim, w, start.role, ready_s=sim.now)
            sim.fleet.on_heartbeat(w.heartbeat(interval_ms), sim.now)

    def signals(self, sim: Simulation) -> Signals:
        workers = tuple(
            WorkerSignal(
                w.worker_id,
                w.role,
                w.rack,
                w.busy_share,
                len(w.waiting) + len(w.admitting),
                sim.cap(w),
                starting=w.power == "starting",
                draining=w.power == "draining",
            )
            for w in sim.workers.values()
            if w.power != "off"
        )
        racks = tuple(
            RackSignal(
                rack.name,
                rack.power_cap_kw,
                sim.last_power[rack.name],
                tuple(wid for wid in rack.worker_ids if sim.workers[wid].power == "off"),
            )
            for rack in sim.inventory.racks
        )
        ttft, itl = sim.recent_ttft, sim.recent_itl
        signals = Signals(
            sim.now,
            workers,
            racks,
            percentile(ttft, 99) if ttft else None,
            percentile(itl, 99) if itl else None,
        )
        sim.recent_ttft, sim.recent_itl = [], []
        return signals

    def apply(self, sim: Simulation, decision: Decision) -> None:
        self.blocked += decision.blocked
        for start in decision.start:
            self._start(sim, sim.workers[start.node], start.role, sim.now + self.scaling.start_s)
        interval_ms = int(sim.cfg.heartbeat_s * 1000)
        for wid in decision.drain:
            w = sim.workers[wid]
            w.power = "draining"
            self.drained += 1
            # The drain is announced at once: the router places nothing new on it.
            sim.fleet.on_heartbeat(w.heartbeat(interval_ms), sim.now)

    def _start(self, sim: Simulation, w: SimWorker, role: str, ready_s: float) -> None:
        # A fresh process: nothing cached from the node's previous worker.
        for key in w.cache:
            sim.prefix_index.get(key, set()).discard(w.worker_id)
        w.cache.clear()
        w.role = role
        w.busy_share = 0.0
        w.power = "on" if ready_s <= sim.now else "starting"
        w.ready_s = ready_s
        self.started += 1


def full_load_kw(node: NodeSpec, config: SimConfig) -> dict[str, float]:
    """A worker's accelerators' draw at full load by role, in the simulator's power model: a
    prefill draws all of their TDP, a full decode batch `decode_power_share` of it above idle."""
    tdp_kw = node.gpus * node.gpu_tdp_w / 1000
    idle = config.idle_power_share
    return {"prefill": tdp_kw, "decode": tdp_kw * (idle + (1 - idle) * config.decode_power_share)}
