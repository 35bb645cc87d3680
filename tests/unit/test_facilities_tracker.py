"""The router-side RackStateTracker: worker -> rack state, caps, ordering, staleness."""

from __future__ import annotations

from tokenyard.facilities.tracker import UNKNOWN, RackStateTracker
from tokenyard.v1.facilities_pb2 import RackState, RackStateKind


def state(
    rack: str,
    kind: RackStateKind.ValueType,
    sent: float,
    cap: int = 0,
    workers: tuple[str, ...] = (),
) -> RackState:
    return RackState(
        rack=rack,
        state=kind,
        reason="r",
        sent_unix_s=sent,
        heartbeat_s=5.0,
        max_seqs_per_worker=cap,
        worker_ids=workers,
    )


def test_unknown_worker_is_normal() -> None:
    assert RackStateTracker().state_for_worker("nobody", now=0) is UNKNOWN
    assert UNKNOWN.state == "normal"


def test_states_per_worker() -> None:
    t = RackStateTracker(derate_penalty=0.7, drain_retry_after_s=12)
    t.apply(state("rack-a", RackStateKind.RACK_STATE_DRAIN, 100, workers=("decode-0",)))
    t.apply(
        state(
            "rack-b", RackStateKind.RACK_STATE_DERATE, 100, cap=4, workers=("decode-1", "prefill-1")
        )
    )
    a = t.state_for_worker("decode-0", now=101)
    assert (a.rack, a.state, a.retry_after_s, a.cost_penalty) == ("rack-a", "drain", 12, 0.0)
    b = t.state_for_worker("prefill-1", now=101)
    assert (b.state, b.seq_cap, b.cost_penalty) == ("derate", 4, 0.7)
    assert set(t.by_worker(now=101)) == {"decode-0", "decode-1", "prefill-1"}


def test_older_messages_do_not_overwrite_newer() -> None:
    t = RackStateTracker()
    t.apply(state("rack-a", RackStateKind.RACK_STATE_NORMAL, 200, workers=("w",)))
    t.apply(state("rack-a", RackStateKind.RACK_STATE_DRAIN, 150, workers=("w",)))
    assert t.state_for_worker("w", now=201).state == "normal"


def test_a_stale_drain_becomes_a_cautious_derate() -> None:
    t = RackStateTracker()  # stale after max(15 s, 3 x 5 s heartbeat) = 15 s
    t.apply(state("rack-a", RackStateKind.RACK_STATE_DRAIN, 100, workers=("w",)))
    assert t.state_for_worker("w", now=115).state == "drain"
    stale = t.state_for_worker("w", now=116)
    assert (stale.state, stale.seq_cap) == ("derate", 1)
    assert "stale" in stale.reason
    t.apply(state("rack-b", RackStateKind.RACK_STATE_NORMAL, 100, workers=("v",)))
    assert t.state_for_worker("v", now=1000).state == "normal"


def test_the_router_places_around_drained_racks() -> None:
    """The router's wiring: tracker -> WorkerThrottle per worker -> choose()."""
    from tokenyard.fleet import WorkerView
    from tokenyard.routing.policy import RouteInput, choose
    from tokenyard.v1 import serving_pb2 as pb

    workers = {
        w: WorkerView(
            pb.WorkerHeartbeat(
                worker_id=w,
                role="both",
                model="m",
                max_num_seqs=8,
                num_blocks=100,
                num_free_blocks=100,
            ),
            last_seen=0.0,
        )
        for w in ("both-1", "both-2")
    }
    request = RouteInput("r1", "m", 10)
    t = RackStateTracker(drain_retry_after_s=7, clock=lambda: 101.0)
    t.apply(state("rack-a", RackStateKind.RACK_STATE_DRAIN, 100, workers=("both-1",)))
    t.apply(state("rack-b", RackStateKind.RACK_STATE_NORMAL, 100, workers=("both-2",)))
    for _ in range(3):
        placed = choose(workers, request, 0.5, facilities=t.by_worker())
        assert isinstance(placed, pb.Placement) and placed.prefill_worker_id == "both-2"
    t.apply(state("rack-b", RackStateKind.RACK_STATE_DRAIN, 100.5, workers=("both-2",)))
    refused = choose(workers, request, 0.5, facilities=t.by_worker())
    assert isinstance(refused, pb.RouteError)
    assert refused.code == pb.RouteError.ALL_DRAINED and refused.retry_after_s == 7


def test_power_pressure_weighs_load_while_fresh() -> None:
    t = RackStateTracker(headroom_gain=4.0, stale_after_s=15.0)
    msg = state("rack-a", RackStateKind.RACK_STATE_NORMAL, 100, workers=("both-1",))
    msg.power_pressure = 0.5
    t.apply(msg)
    fresh = t.state_for_worker("both-1", now=101)
    assert fresh.state == "normal" and fresh.seq_cap == 0
    assert fresh.load_weight == 3.0 and fresh.cost_penalty == 0.0
    assert t.state_for_worker("both-1", now=130).load_weight == 1.0  # stale: no steering
