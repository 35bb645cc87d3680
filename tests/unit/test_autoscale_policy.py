"""The autoscaler's pure policy: sizing with hysteresis and cool-downs, placement by mode."""

from __future__ import annotations

from tokenyard.autoscale.policy import (
    AutoscaleSettings,
    RackSignal,
    ScalerState,
    Signals,
    WorkerSignal,
    decide,
)


def _worker(i: int, role: str, rack: str, busy: float, queued: int = 0, **kw) -> WorkerSignal:
    return WorkerSignal(f"{role}-{i}", role, rack, busy, queued, 8, **kw)


def _racks(free: dict[str, int], cap_kw: float = 10.0) -> tuple[RackSignal, ...]:
    return tuple(
        RackSignal(name, cap_kw, 0.0, tuple(f"{name}-n{i}" for i in range(n)))
        for name, n in free.items()
    )


def _signals(now: float, workers: list[WorkerSignal], racks, **kw) -> Signals:
    return Signals(now, tuple(workers), racks, **kw)


ONE_KW = {"prefill": 1.0, "decode": 1.0}
BALANCED = [_worker(0, "prefill", "r0", 0.5), _worker(0, "decode", "r0", 0.5)]


def test_a_busy_pool_grows_to_the_target_share():
    workers = [_worker(i, "decode", "r0", 0.9) for i in range(4)] + BALANCED[:1]
    d = decide(_signals(0, workers, _racks({"r0": 8})), ScalerState(), AutoscaleSettings())
    # demand 3.6 at a 0.6 target: 6 decode workers, 2 more
    assert d.desired == {"prefill": 1, "decode": 6}
    assert [s.role for s in d.start] == ["decode", "decode"]
    assert d.drain == ()


def test_a_missed_slo_adds_a_worker_even_at_moderate_load():
    sig = _signals(0, BALANCED, _racks({"r0": 8}), ttft_p99_s=5.0, itl_p99_s=0.01)
    d = decide(sig, ScalerState(), AutoscaleSettings(ttft_p99_s=2.0))
    assert d.desired == {"prefill": 2, "decode": 1}
    assert "SLO" in d.reasons[0]


def test_workers_still_starting_hold_off_a_second_slo_start():
    workers = [*BALANCED, _worker(1, "prefill", "r0", 0.0, starting=True)]
    sig = _signals(0, workers, _racks({"r0": 8}), ttft_p99_s=5.0)
    d = decide(sig, ScalerState(), AutoscaleSettings())
    assert d.start == ()


def test_scale_down_waits_for_low_load_to_hold_and_for_the_cool_down():
    s = AutoscaleSettings(down_after_s=20, down_cooldown_s=30, max_down_share=0.5)
    state = ScalerState()
    workers = [_worker(i, "decode", "r0", 0.1) for i in range(4)] + BALANCED[:1]
    racks = _racks({"r0": 4})
    state.last_event["decode"] = 0.0  # it scaled up at 0
    assert decide(_signals(5, workers, racks), state, s).drain == ()  # low from 5
    assert decide(_signals(20, workers, racks), state, s).drain == ()  # held 15 s only
    # held 25 s and 35 s since the last event: half the pool goes, the least busy first
    d = decide(_signals(35, workers, racks), state, s)
    assert len(d.drain) == 2 and d.desired["decode"] == 2
    # a new low period starts after a scale-down
    assert decide(_signals(36, workers[2:], racks), state, s).drain == ()


def test_load_back_in_the_band_resets_the_low_timer():
    s = AutoscaleSettings(down_after_s=10, down_cooldown_s=0)
    state = ScalerState()
    low = [_worker(i, "decode", "r0", 0.1) for i in range(2)] + BALANCED[:1]
    mid = [_worker(i, "decode", "r0", 0.5) for i in range(2)] + BALANCED[:1]
    racks = _racks({"r0": 4})
    decide(_signals(0, low, racks), state, s)
    decide(_signals(5, mid, racks), state, s)
    assert decide(_signals(12, low, racks), state, s).drain == ()
    assert decide(_signals(23, low, racks), state, s).drain != ()


def test_never_below_the_minimum_nor_above_the_maximum():
    s = AutoscaleSettings(min_workers={"prefill": 2, "decode": 1},
                          max_workers={"prefill": 3, "decode": 2})  # fmt: skip
    d = decide(_signals(0, [], _racks({"r0": 8})), ScalerState(), s)
    assert d.desired == {"prefill": 2, "decode": 1}
    busy = [_worker(i, "decode", "r0", 1.0, queued=20) for i in range(2)] + BALANCED[:1]
    d = decide(_signals(0, busy, _racks({"r0": 8})), ScalerState(), s)
    assert d.desired["decode"] == 2 and not [x for x in d.start if x.role == "decode"]


def test_sla_mode_fills_the_first_free_nodes_whatever_the_power():
    workers = [_worker(i, "decode", "r0", 1.0) for i in range(2)] + BALANCED[:1]
    racks = _racks({"r0": 4, "r1": 4}, cap_kw=2.0)
    s = AutoscaleSettings(mode="sla", worker_full_kw=ONE_KW)
    d = decide(_signals(0, workers, racks), ScalerState(), s)
    assert [x.rack for x in d.start] == ["r0"] * len(d.start) and d.blocked == 0


def test_power_mode_keeps_each_rack_inside_its_budget():
    # r0 holds 3 workers of 1 kW under a 4 kW cap: 0.8 kW of budget left at 0.95
    workers = [_worker(0, "prefill", "r0", 0.5)] + [
        _worker(i, "decode", "r0", 1.0) for i in range(2)
    ]
    racks = (RackSignal("r0", 4.0, 3.0, ("a", "b")), RackSignal("r1", 3.0, 0.0, ("c", "d", "e")))
    s = AutoscaleSettings(mode="power", worker_full_kw=ONE_KW, rack_budget=0.95)
    d = decide(_signals(0, workers, racks), ScalerState(), s)
    # demand 2 / 0.6: 4 decode workers wanted; r1 takes two (2 kW of its 2.85), r0 none
    assert [x.rack for x in d.start] == ["r1", "r1"]
    assert d.desired["decode"] == 4 and d.blocked == 0
    more = [_worker(i, "decode", "r0", 1.0, queued=8) for i in range(2)] + workers[:1]
    d = decide(_signals(0, more, racks), ScalerState(), s)
    assert d.blocked > 0 and len(d.start) == 2
    assert d.desired["decode"] == 4  # what will run: the starts that found a rack


def test_power_mode_drains_the_rack_with_the_least_budget_first():
    workers = [
        _worker(0, "prefill", "r1", 0.5),
        _worker(1, "decode", "r0", 0.0),
        _worker(2, "decode", "r1", 0.1),
        _worker(3, "decode", "r1", 0.2),
    ]
    racks = (RackSignal("r0", 10.0, 1.0, ()), RackSignal("r1", 4.0, 3.0, ()))
    s = AutoscaleSettings(mode="power", worker_full_kw=ONE_KW, down_after_s=0, down_cooldown_s=0,
                          max_down_share=0.5)  # fmt: skip
    state = ScalerState()
    decide(_signals(0, workers, racks), state, s)
    d = decide(_signals(1, workers, racks), state, s)
    assert d.drain == ("decode-2",)  # r1 is the tighter rack; its least busy decoder
    d_sla = decide(_signals(1, workers, racks), ScalerState(low_since={"prefill": None,
                   "decode": 0.0}), AutoscaleSettings(mode="sla", down_after_s=0,
                   down_cooldown_s=0, max_down_share=0.5))  # fmt: skip
    assert d_sla.drain == ("decode-1",)  # the least busy, wherever it is
