"""Per-rack state from readings: normal, derate or drain. Pure functions, no I/O.

Each signal (power against the cap, coolant supply and return temperature against their
limits, coolant flow against its minimum, data age) maps to a level through a `Band` with
separate enter and exit thresholds (hysteresis): a rack in derate stays there until the
signal is back under the *exit* threshold, which is milder than the enter threshold.

The rack's target is the worst level of any signal. Escalation is immediate (a pump
failure must drain now); de-escalation waits until the milder target has held for
`dwell_s` without interruption, so a flapping signal cannot flap the placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Literal


class State(IntEnum):
    # NOTE: ordered by severity; the policy takes max() over signals.
    NORMAL = 0
    DERATE = 1
    DRAIN = 2

    @property
    def label(self) -> StateName:
        return _LABELS[self]


StateName = Literal["normal", "derate", "drain"]
_LABELS: dict[State, StateName] = {
    State.NORMAL: "normal",
    State.DERATE: "derate",
    State.DRAIN: "drain",
}


@dataclass(frozen=True)
class Reading:
    rack: str
    ts: float  # unix seconds, when measured
    power_kw: float
    supply_c: float | None = None
    return_c: float | None = None
    flow_lpm: float | None = None
    inlet_air_c: float | None = None
    source: str = "simulator"


@dataclass(frozen=True)
class RackLimits:
    power_cap_kw: float
    supply_limit_c: float | None = None
    return_limit_c: float | None = None
    min_flow_lpm: float | None = None


@dataclass(frozen=True)
class Band:
    """Enter/exit thresholds of one signal, in that signal's units.

    For a signal where higher is worse, enter >= exit; where lower is worse (flow), the
    reverse. Drain thresholds are beyond derate thresholds.
    """

    derate_enter: float
    derate_exit: float
    drain_enter: float
    drain_exit: float
    higher_is_worse: bool = True


@dataclass(frozen=True)
class PolicySettings:
    dwell_s: float = 30.0
    stale_after_s: float = 10.0
    # power / cap. NOTE: power never drains a rack. Past its cap the rack's power capping
    # slows it by itself; a drain sent its whole load to the neighbouring racks, which then
    # crossed their own caps (a cascade to ALL_DRAINED in the fleet simulator). A power
    # derate steers new work away (docs/facilities.md); coolant signals still drain.
    power: Band = Band(
        derate_enter=0.95, derate_exit=0.90, drain_enter=math.inf, drain_exit=math.inf
    )
    # supply temperature - supply limit (degrees C)
    supply: Band = Band(derate_enter=-2.0, derate_exit=-3.0, drain_enter=0.0, drain_exit=-1.0)
    # return temperature - return limit (degrees C)
    return_: Band = Band(derate_enter=-3.0, derate_exit=-5.0, drain_enter=0.0, drain_exit=-2.0)
    # flow / minimum flow
    flow: Band = Band(
        derate_enter=1.15, derate_exit=1.25, drain_enter=1.0, drain_exit=1.05, higher_is_worse=False
    )
    # The cap on concurrent sequences per worker in a derated rack, as a fraction of the
    # worker's own max_num_seqs (at least 1). Not for a derate on power alone (see seq_cap).
    derate_seq_fraction: float = 0.5
    # Power over cap from which the router is told to steer new work away from the rack
    # (RackState.power_pressure), so that load moves before the rack has to derate.
    steer_from: float = 0.5


@dataclass(frozen=True)
class RackStatus:
    state: State
    since: float  # when the rack entered `state`
    reason: str
    calm_since: float | None = None  # since when the signals have allowed a milder state
    # Whether a derate caps concurrent sequences: not when power alone derates the rack.
    caps_seqs: bool = True


@dataclass(frozen=True)
class Signal:
    name: str
    level: State
    text: str


def initial_status(now: float) -> RackStatus:
    return RackStatus(State.NORMAL, since=now, reason="no data yet")


def band_level(value: float, band: Band, prev: State) -> State:
    """The level of one signal, given the rack's previous state (hysteresis)."""
    sign = 1.0 if band.higher_is_worse else -1.0
    v = sign * value

    def beyond(threshold: float) -> bool:
        return v >= sign * threshold

    def still_beyond(exit_threshold: float) -> bool:
        return v > sign * exit_threshold

    if beyond(band.drain_enter) or (prev >= State.DRAIN and still_beyond(band.drain_exit)):
        return State.DRAIN
    if beyond(band.derate_enter) or (prev >= State.DERATE and still_beyond(band.derate_exit)):
        return State.DERATE
    return State.NORMAL


def signals(
    reading: Reading | None, limits: RackLimits, prev: State, now: float, settings: PolicySettings
) -> list[Signal]:
    """Every signal's level and a human-readable reason."""
    out: list[Signal] = []
    age = math.inf if reading is None else now - reading.ts
    if age > settings.stale_after_s:
        # NOTE: stale data derates but never clears what the last reading said (below).
        seen = "no reading yet" if reading is None else f"no reading for {age:.0f} s"
        out.append(
            Signal(
                "stale",
                State.DERATE,
                f"{seen} (stale after {settings.stale_after_s:.0f} s)",
            )
        )
    if reading is None:
        return out
    ratio = reading.power_kw / limits.power_cap_kw
    out.append(
        Signal(
            "power",
            band_level(ratio, settings.power, prev),
            f"power {reading.power_kw:.1f} kW is {ratio:.0%} of the {limits.power_cap_kw:.1f} kW cap",
        )
    )
    if reading.supply_c is not None and limits.supply_limit_c is not None:
        level = band_level(reading.supply_c - limits.supply_limit_c, settings.supply, prev)
        out.append(
            Signal(
                "supply",
                level,
                f"coolant supply {reading.supply_c:.1f} C (limit {limits.supply_limit_c:.1f} C)",
            )
        )
    if reading.return_c is not None and limits.return_limit_c is not None:
        level = band_level(reading.return_c - limits.return_limit_c, settings.return_, prev)
        out.append(
            Signal(
                "return",
                level,
                f"coolant return {reading.return_c:.1f} C (limit {limits.return_limit_c:.1f} C)",
            )
        )
    if reading.flow_lpm is not None and limits.min_flow_lpm:
        level = band_level(reading.flow_lpm / limits.min_flow_lpm, settings.flow, prev)
        out.append(
            Signal(
                "flow",
                level,
                f"coolant flow {reading.flow_lpm:.1f} L/min (minimum {limits.min_flow_lpm:.1f} L/min)",
            )
        )
    return out


def describe(found: list[Signal]) -> str:
    bad = [s for s in found if s.level > State.NORMAL]
    if not bad:
        return "all readings within limits"
    bad.sort(key=lambda s: -s.level)
    return "; ".join(f"{s.level.label}: {s.text}" for s in bad)


def evaluate(
    reading: Reading | None,
    limits: RackLimits,
    prev: RackStatus,
    now: float,
    settings: PolicySettings,
) -> RackStatus:
    """The rack's next status from its latest reading (possibly old) and its previous status."""
    found = signals(reading, limits, prev.state, now, settings)
    target = max((s.level for s in found), default=State.NORMAL)
    reason = describe(found)
    caps = any(s.level >= max(target, State.DERATE) and s.name != "power" for s in found)
    if target > prev.state:
        return RackStatus(target, since=now, reason=reason, caps_seqs=caps)
    if target == prev.state:
        return replace(prev, reason=reason, calm_since=None, caps_seqs=caps)
    # Milder target: only after it has held for the dwell time.
    calm_since = prev.calm_since if prev.calm_since is not None else now
    if now - calm_since >= settings.dwell_s:
        return RackStatus(
            target, since=now, reason=f"{reason} for {now - calm_since:.0f} s", caps_seqs=caps
        )
    return replace(prev, calm_since=calm_since)


def seq_cap(
    state: State, max_num_seqs: int, settings: PolicySettings, caps_seqs: bool = True
) -> int:
    """Concurrent sequences a worker in this rack may run; 0 = none new (drain).

    NOTE: a derate on power alone does not cap sequences. The rack's own power capping
    already slows it; halving its workers' caps on top pushed their load onto the
    neighbouring racks, which then crossed their own thresholds (a cascade, measured in
    docs/planning.md). Power derates steer new work away instead (the derate penalty and
    RackState.power_pressure); coolant derates, which hardware does not handle, still cap.
    """
    if state is State.DRAIN:
        return 0
    if state is State.DERATE and caps_seqs:
        return max(1, math.floor(max_num_seqs * settings.derate_seq_fraction))
    return max_num_seqs


def power_pressure(reading: Reading | None, limits: RackLimits, settings: PolicySettings) -> float:
    """0 while the rack draws at most `steer_from` of its cap, 1 at the derate threshold and
    beyond: how hard the router should steer new work elsewhere (a soft, early signal; the
    states above are the hard ones)."""
    if reading is None or limits.power_cap_kw <= 0:
        return 0.0
    ratio = reading.power_kw / limits.power_cap_kw
    span = settings.power.derate_enter - settings.steer_from
    if span <= 0:
        return 1.0 if ratio >= settings.power.derate_enter else 0.0
    return min(1.0, max(0.0, (ratio - settings.steer_from) / span))
