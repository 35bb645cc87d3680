"""The built-in source of readings: rack power from the workers' real load, and a coolant loop.

    power_kw  = idle_kw + sum over nodes of gpus x gpu_tdp_w x utilization / 1000
    return_c  -> supply_c + power_kw / (mass_flow_kg_s x heat_capacity_kj_kg_k)
    supply_c  -> nominal supply (+ the rise of a failed chiller)

Temperatures follow their targets with a first-order lag (the thermal mass of the coolant
and the cold plates): T += (T_target - T) x (1 - exp(-dt / tau)). Flow follows the pump at
once. Utilization comes from worker heartbeats (batch occupancy or token rate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenyard.facilities.energy import busy_watts
from tokenyard.facilities.faults import FaultKind
from tokenyard.facilities.inventory import CoolantLoopSpec, RackSpec
from tokenyard.facilities.policy import Reading
from tokenyard.v1.serving_pb2 import WorkerHeartbeat


@dataclass(frozen=True)
class SimSettings:
    time_constant_s: float = 20.0
    heat_capacity_kj_kg_k: float = 4.186  # water; a 25% glycol mix is about 3.9
    density_kg_l: float = 1.0
    room_air_c: float = 24.0
    pump_failure_flow_fraction: float = 0.1
    chiller_failure_supply_rise_c: float = 12.0
    # A worker at this token rate counts as fully busy even with few sequences; 0 = ignore.
    full_tokens_per_s: float = 0.0


@dataclass
class Faults:
    """Injected through the admin API; cleared by replacing with Faults()."""

    pump_failure: bool = False
    chiller_failure: bool = False
    power_cap_kw: float | None = None  # a lowered cap (a limit, not a reading)
    dead_sensor: bool = False  # readings stop

    def active(self) -> list[FaultKind]:
        names: list[FaultKind] = []
        if self.pump_failure:
            names.append("pump_failure")
        if self.chiller_failure:
            names.append("chiller_failure")
        if self.power_cap_kw is not None:
            names.append("power_cap")
        if self.dead_sensor:
            names.append("dead_sensor")
        return names


def utilization(hb: WorkerHeartbeat, full_tokens_per_s: float) -> float:
    """0..1 from batch occupancy, or from the token rate when that is configured and higher."""
    occupancy = hb.num_running / hb.max_num_seqs if hb.max_num_seqs else 0.0
    rate = hb.tokens_per_s / full_tokens_per_s if full_tokens_per_s > 0 else 0.0
    return min(1.0, max(occupancy, rate))


def rack_power_kw(rack: RackSpec, utils: dict[str, float]) -> float:
    watts = 0.0
    for node in rack.nodes:
        # The node's GPUs are shared by whichever of its workers are running (have a fresh
        # heartbeat); an inventory may list workers that this deployment does not start.
        running = [utils[w] for w in node.workers if w in utils]
        if running:
            watts += busy_watts(node.gpus, node.gpu_tdp_w, sum(running) / len(running))
    return rack.idle_power_kw + watts / 1000.0


def coolant_rise_c(power_kw: float, flow_lpm: float, settings: SimSettings) -> float:
    mass_flow_kg_s = max(flow_lpm, 1e-3) / 60.0 * settings.density_kg_l
    return power_kw / (mass_flow_kg_s * settings.heat_capacity_kj_kg_k)


class RackSimulator:
    """One rack's thermal state between steps."""

    def __init__(
        self, rack: RackSpec, loop: CoolantLoopSpec | None, settings: SimSettings, now: float
    ) -> None:
        self.rack = rack
        self.loop = loop
        self.settings = settings
        self.last = now
        self.supply_c = loop.nominal_supply_c if loop else None
        self.return_c = self.supply_c

    def step(self, now: float, utils: dict[str, float], faults: Faults) -> Reading:
        dt = max(0.0, now - self.last)
        self.last = now
        power = rack_power_kw(self.rack, utils)
        inlet = self.settings.room_air_c + (3.0 if faults.chiller_failure else 0.0)
        if self.loop is None or self.supply_c is None or self.return_c is None:
            return Reading(self.rack.name, now, power, inlet_air_c=inlet, source="simulator")
        lag = (
            1.0 - math.exp(-dt / self.settings.time_constant_s)
            if self.settings.time_constant_s > 0
            else 1.0
        )
        flow = self.loop.nominal_flow_lpm * (
            self.settings.pump_failure_flow_fraction if faults.pump_failure else 1.0
        )
        supply_target = self.loop.nominal_supply_c + (
            self.settings.chiller_failure_supply_rise_c if faults.chiller_failure else 0.0
        )
        self.supply_c += (supply_target - self.supply_c) * lag
        return_target = self.supply_c + coolant_rise_c(power, flow, self.settings)
        self.return_c += (return_target - self.return_c) * lag
        return Reading(
            self.rack.name,
            now,
            power_kw=power,
            supply_c=self.supply_c,
            return_c=self.return_c,
            flow_lpm=flow,
            inlet_air_c=inlet,
            source="simulator",
        )
