"""The fleet: roles, the one liveness rule, the view fed by heartbeats, resume candidates.

Scripted heartbeats and an explicit clock; no NATS.
"""

from __future__ import annotations

import pytest

from tokenyard.fleet import (
    ROLES,
    FleetView,
    can_decode,
    can_prefill,
    is_alive,
    missing_role,
    resume_candidates,
)
from tokenyard.v1 import serving_pb2 as pb


def hb(worker_id: str, role: str, interval_ms: int = 1000, **kw) -> pb.WorkerHeartbeat:
    return pb.WorkerHeartbeat(
        worker_id=worker_id, role=role, model="m", heartbeat_interval_ms=interval_ms, **kw
    )


def test_roles_say_which_part_of_a_request_each_can_do():
    assert ROLES == ("prefill", "decode", "both")
    assert [can_prefill(r) for r in ROLES] == [True, False, True]
    assert [can_decode(r) for r in ROLES] == [False, True, True]
    assert not can_prefill("") and not can_decode("router")


def test_liveness_is_the_age_against_a_multiple_of_the_announced_interval():
    assert is_alive(3.0, 1.0, missed=3) and not is_alive(3.01, 1.0, missed=3)
    assert is_alive(5.9, 2.0) and not is_alive(6.1, 2.0)  # three missed beats by default
    assert is_alive(0.9, 0.5, missed=2) and not is_alive(1.1, 0.5, missed=2)


def test_each_worker_is_judged_by_its_own_interval():
    fleet = FleetView(missed_heartbeats=3)
    fleet.on_heartbeat(hb("fast", "decode", interval_ms=200), now=0.0)
    fleet.on_heartbeat(hb("slow", "decode", interval_ms=2000), now=0.0)
    fleet.on_heartbeat(hb("quiet", "decode", interval_ms=0), now=0.0)  # announces none: 1 s

    def alive(now: float) -> list[str]:
        return sorted(w.worker_id for w in fleet.live(now))

    assert alive(0.6) == ["fast", "quiet", "slow"]
    assert alive(0.7) == ["quiet", "slow"]
    assert alive(3.1) == ["slow"]
    assert alive(6.1) == []
    assert fleet.is_dead("fast", 0.7) and not fleet.alive("fast", 0.7)
    assert fleet.alive("slow", 0.7) and not fleet.is_dead("slow", 0.7)


def test_an_unknown_worker_is_neither_alive_nor_dead():
    fleet = FleetView()
    assert not fleet.alive("never-seen", 0.0) and not fleet.is_dead("never-seen", 0.0)
    assert "never-seen" not in fleet and fleet.get("never-seen") is None


def test_a_new_heartbeat_brings_a_silent_worker_back():
    fleet = FleetView()
    fleet.on_heartbeat(hb("d1", "decode"), now=0.0)
    assert fleet.is_dead("d1", 5.0)
    fleet.on_heartbeat(hb("d1", "decode"), now=5.0)
    assert fleet.alive("d1", 5.0) and fleet.get("d1").age(6.5) == pytest.approx(1.5)


def test_dead_workers_are_forgotten_only_after_the_grace():
    fleet = FleetView(missed_heartbeats=3)
    fleet.on_heartbeat(hb("gone", "prefill"), now=0.0)  # dead after 3 s
    fleet.on_heartbeat(hb("here", "prefill"), now=12.0)
    assert fleet.forget_dead(12.9, grace_s=10.0) == []
    assert "gone" in fleet and fleet.is_dead("gone", 12.9)
    assert fleet.forget_dead(13.1, grace_s=10.0) == ["gone"]
    assert "gone" not in fleet and "here" in fleet


def test_pending_placements_spread_a_burst_until_the_next_beat():
    fleet = FleetView()
    fleet.on_heartbeat(hb("p1", "prefill", max_num_seqs=4), 0.0)
    fleet.placed("p1")
    fleet.placed("p1")
    fleet.placed("unknown")  # nothing to count against
    assert fleet.workers["p1"].load == 2 and "unknown" not in fleet
    fleet.on_heartbeat(hb("p1", "prefill", num_running=2), 0.5)
    assert fleet.workers["p1"].load == 2 and fleet.workers["p1"].pending == 0


def test_zero_fields_of_a_heartbeat_read_as_their_defaults():
    fleet = FleetView()
    fleet.on_heartbeat(pb.WorkerHeartbeat(worker_id="w", role="both"), 0.0)
    w = fleet.workers["w"]
    assert (w.interval_s, w.max_num_seqs, w.block_size, w.seq_cap, w.kv_used) == (
        1.0,
        1,
        16,
        0,
        0.0,
    )
    fleet.on_heartbeat(pb.WorkerHeartbeat(worker_id="w", num_free_blocks=25, num_blocks=100), 1)
    assert fleet.workers["w"].kv_used == pytest.approx(0.75)


def test_roles_missing_roles_and_context_of_the_live_workers():
    fleet = FleetView(missed_heartbeats=3)
    assert missing_role(fleet.live(0)) == "prefill"
    fleet.on_heartbeat(hb("p", "prefill", max_model_len=2048), now=0)
    assert missing_role(fleet.live(0)) == "decode"
    fleet.on_heartbeat(hb("d", "decode", max_model_len=1024), now=1)
    # The longest live context: a worker claiming a short one shortens nobody else's.
    assert missing_role(fleet.live(1)) is None and fleet.max_model_len(1) == 2048
    assert fleet.roles(1) == {"prefill": 1, "decode": 1}
    # 3 missed beats of 1 s: p (last seen at 0) is dead at 3.5, d (at 1) is not
    assert fleet.is_dead("p", 3.5) and not fleet.is_dead("d", 3.5)
    assert missing_role(fleet.live(3.5)) == "prefill" and fleet.max_model_len(3.5) == 1024


def test_a_both_worker_serves_every_role():
    fleet = FleetView()
    fleet.on_heartbeat(hb("b", "both"), now=0)
    assert missing_role(fleet.live(0)) is None and fleet.models(0) == {"m"}


# --- resume candidates ----------------------------------------------------------------


def busy(worker_id: str, role: str, running: int, free: int) -> pb.WorkerHeartbeat:
    return hb(worker_id, role, num_running=running, num_free_blocks=free, num_blocks=100)


@pytest.fixture
def fleet() -> FleetView:
    """Scripted at t=0..2: four decode-capable workers, a prefill worker, one gone silent."""
    fleet = FleetView(missed_heartbeats=3)
    fleet.on_heartbeat(busy("silent", "decode", 0, 100), now=0.0)  # dead from t=3
    fleet.on_heartbeat(busy("d-busy", "decode", 3, 100), now=2.0)
    fleet.on_heartbeat(busy("d-idle", "decode", 1, 50), now=2.0)
    fleet.on_heartbeat(busy("both", "both", 1, 90), now=2.0)
    fleet.on_heartbeat(busy("dying", "decode", 0, 100), now=2.0)
    fleet.on_heartbeat(busy("p", "prefill", 0, 100), now=2.0)
    return fleet


def test_resume_candidates_are_live_decoders_least_busy_first(fleet):
    now = 3.5
    # Equal load: more free KV blocks first; a prefill-only worker last; a silent one never.
    assert resume_candidates(fleet.live(now), exclude="dying") == ["both", "d-idle", "d-busy", "p"]
    assert resume_candidates(fleet.live(now), exclude="both") == ["dying", "d-idle", "d-busy", "p"]


def test_prefill_workers_resume_when_no_decode_worker_is_live():
    fleet = FleetView(missed_heartbeats=3)
    fleet.on_heartbeat(busy("d", "decode", 0, 100), now=0.0)
    fleet.on_heartbeat(busy("p-busy", "prefill", 2, 100), now=0.0)
    fleet.on_heartbeat(busy("p-idle", "prefill", 0, 100), now=0.0)
    assert resume_candidates(fleet.live(1.0), exclude="d") == ["p-idle", "p-busy"]
    assert resume_candidates(fleet.live(1.0), exclude="p-idle") == ["d", "p-busy"]


def test_resume_candidates_follow_the_clock(fleet):
    fleet.on_heartbeat(busy("d-busy", "decode", 3, 100), now=4.0)  # only d-busy keeps beating
    assert resume_candidates(fleet.live(4.9), exclude="dying") == [
        "both",
        "d-idle",
        "d-busy",
        "p",
    ]
    assert resume_candidates(fleet.live(5.1), exclude="dying") == ["d-busy"]
    assert resume_candidates(fleet.live(7.1), exclude="dying") == []


def test_resume_candidates_count_placements_since_the_last_beat(fleet):
    for _ in range(3):
        fleet.placed("both")
    assert resume_candidates(fleet.live(3.5), exclude="dying") == [
        "d-idle",
        "d-busy",
        "both",
        "p",
    ]


def test_equal_candidates_are_ordered_by_worker_id():
    fleet = FleetView()
    for worker_id in ("d2", "d3", "d1"):
        fleet.on_heartbeat(busy(worker_id, "decode", 0, 10), now=0.0)
    assert resume_candidates(fleet.live(0.0), exclude="x") == ["d1", "d2", "d3"]


def test_a_drained_worker_is_no_resume_candidate(fleet):
    fleet.on_heartbeat(
        hb("d-idle", "decode", num_running=1, num_free_blocks=50, num_blocks=100, draining=True),
        now=2.0,
    )
    assert resume_candidates(fleet.live(3.5), exclude="dying") == ["both", "d-busy", "p"]
