"""The rack policy on scripted reading sequences: enter, hysteresis, dwell, exit, stale data."""

from __future__ import annotations

import pytest

from tokenyard.facilities.policy import (
    PolicySettings,
    RackLimits,
    RackStatus,
    Reading,
    State,
    evaluate,
    initial_status,
    seq_cap,
)

LIMITS = RackLimits(power_cap_kw=10.0, supply_limit_c=32.0, return_limit_c=45.0, min_flow_lpm=20.0)
SETTINGS = PolicySettings(dwell_s=30.0, stale_after_s=10.0)


def reading(
    ts: float, power: float = 5.0, supply: float = 25.0, ret: float = 30.0, flow: float = 30.0
) -> Reading:
    return Reading("rack-a", ts, power_kw=power, supply_c=supply, return_c=ret, flow_lpm=flow)


def run(script: list[Reading], start: RackStatus | None = None) -> list[RackStatus]:
    """Evaluate each reading at its own timestamp; returns the status after each."""
    status = start or initial_status(script[0].ts)
    out = []
    for r in script:
        status = evaluate(r, LIMITS, status, r.ts, SETTINGS)
        out.append(status)
    return out


def states(statuses: list[RackStatus]) -> list[State]:
    return [s.state for s in statuses]


def test_normal_readings_stay_normal() -> None:
    got = run([reading(t) for t in range(5)])
    assert states(got) == [State.NORMAL] * 5
    assert got[-1].reason == "all readings within limits"


@pytest.mark.parametrize(
    ("kwargs", "state", "word"),
    [
        ({"power": 9.6}, State.DERATE, "power"),
        ({"power": 10.6}, State.DERATE, "power"),  # power never drains (the policy's NOTE)
        ({"supply": 30.5}, State.DERATE, "supply"),
        ({"supply": 32.5}, State.DRAIN, "supply"),
        ({"ret": 42.5}, State.DERATE, "return"),
        ({"ret": 46.0}, State.DRAIN, "return"),
        ({"flow": 22.0}, State.DERATE, "flow"),
        ({"flow": 3.0}, State.DRAIN, "flow"),
    ],
)
def test_each_signal_enters_its_state_at_once(
    kwargs: dict[str, float], state: State, word: str
) -> None:
    got = run([reading(0), reading(1, **kwargs)])
    assert got[1].state == state
    assert got[1].since == 1
    assert word in got[1].reason and state.label in got[1].reason


def test_hysteresis_holds_between_exit_and_enter_thresholds() -> None:
    # 9.6 kW enters derate (>= 95% of cap); 9.2 kW (92%) is under enter but over exit (90%).
    got = run([reading(0, power=9.6)] + [reading(t, power=9.2) for t in range(1, 100, 5)])
    assert set(states(got)) == {State.DERATE}
    # From normal, 9.2 kW never enters.
    assert set(states(run([reading(t, power=9.2) for t in range(0, 100, 5)]))) == {State.NORMAL}


def test_flow_hysteresis_lower_is_worse() -> None:
    got = run([reading(0, flow=19.0), reading(1, flow=20.5), reading(2, flow=21.5)])
    # 19 < minimum: drain; 20.5 is under the drain exit (21 = 1.05 x 20): still drain;
    # 21.5 is over the drain exit but under the derate exit (25): derate after the dwell only.
    assert states(got) == [State.DRAIN, State.DRAIN, State.DRAIN]


def test_exit_waits_for_dwell_then_drops_to_target() -> None:
    script = [reading(0, flow=3.0)] + [reading(t) for t in (1, 10, 20, 30, 31, 40)]
    got = run(script)
    # Calm from t=1; dwell 30 s -> normal at t=31, not before.
    assert states(got) == [State.DRAIN] * 5 + [State.NORMAL, State.NORMAL]
    assert got[5].since == 31
    assert "within limits" in got[5].reason


def test_a_relapse_during_dwell_restarts_the_clock() -> None:
    script = [
        reading(0, power=9.6),
        reading(1),
        reading(20),
        reading(25, power=9.6),
        reading(40),
        reading(56),
        reading(70),
    ]
    got = run(script)
    # Calm from 1, relapse at 25 (same state, the calm clock resets), calm again from 40 -> 70.
    assert states(got) == [State.DERATE] * 6 + [State.NORMAL]


def test_escalation_during_dwell_is_immediate() -> None:
    got = run([reading(0, power=9.6), reading(1), reading(2, flow=3.0)])
    assert states(got) == [State.DERATE, State.DERATE, State.DRAIN]
    assert got[2].since == 2


def test_stale_data_derates_and_fresh_data_recovers_after_dwell() -> None:
    status = evaluate(reading(0), LIMITS, initial_status(0), 0, SETTINGS)
    assert status.state is State.NORMAL
    last = reading(0)
    status = evaluate(last, LIMITS, status, 10.0, SETTINGS)  # exactly at the limit: still fresh
    assert status.state is State.NORMAL
    status = evaluate(last, LIMITS, status, 10.5, SETTINGS)
    assert status.state is State.DERATE
    assert "no reading for 10 s" in status.reason
    # Readings resume at t=20; normal again once calm for the dwell (t=50).
    got = run([reading(t) for t in (20, 30, 49, 50)], start=status)
    assert states(got) == [State.DERATE, State.DERATE, State.DERATE, State.NORMAL]


def test_no_reading_ever_is_stale() -> None:
    status = evaluate(None, LIMITS, initial_status(0), 11.0, SETTINGS)
    assert status.state is State.DERATE
    assert "no reading yet" in status.reason


def test_stale_data_never_clears_a_drain() -> None:
    bad = reading(0, flow=3.0)
    status = evaluate(bad, LIMITS, initial_status(0), 0, SETTINGS)
    for t in (20, 60, 120):  # the sensor died while the pump was down
        status = evaluate(bad, LIMITS, status, t, SETTINGS)
    assert status.state is State.DRAIN


def test_missing_coolant_fields_are_not_judged() -> None:
    air = Reading("rack-b", 0, power_kw=5.0, inlet_air_c=40.0)
    assert evaluate(air, LIMITS, initial_status(0), 0, SETTINGS).state is State.NORMAL


def test_seq_cap() -> None:
    assert seq_cap(State.NORMAL, 8, SETTINGS) == 8
    assert seq_cap(State.DERATE, 8, SETTINGS) == 4
    assert seq_cap(State.DERATE, 1, SETTINGS) == 1
    assert seq_cap(State.DRAIN, 8, SETTINGS) == 0


def test_a_power_derate_steers_and_caps_no_sequences_a_coolant_derate_caps() -> None:
    power = run([reading(0, power=9.6)])[-1]
    assert power.state is State.DERATE and not power.caps_seqs
    assert seq_cap(power.state, 32, SETTINGS, power.caps_seqs) == 32
    supply = run([reading(0, power=9.6, supply=30.5)])[-1]
    assert supply.state is State.DERATE and supply.caps_seqs
    assert seq_cap(supply.state, 32, SETTINGS, supply.caps_seqs) == 16
    # Power far past the cap derates (steers, caps nothing); only coolant drains.
    far = run([reading(0, power=16.0)])[-1]
    assert far.state is State.DERATE and not far.caps_seqs
    assert run([reading(0, power=16.0, flow=3.0)])[-1].state is State.DRAIN


@pytest.mark.parametrize(
    ("power", "pressure"), [(4.0, 0.0), (5.0, 0.0), (7.25, 0.5), (9.5, 1.0), (12.0, 1.0)]
)
def test_power_pressure_rises_from_steer_from_to_the_derate_threshold(power, pressure) -> None:
    from tokenyard.facilities.policy import power_pressure

    got = power_pressure(reading(0, power=power), LIMITS, SETTINGS)
    assert got == pytest.approx(pressure)
    assert power_pressure(None, LIMITS, SETTINGS) == 0.0
