"""Which workers the gateway takes a request's chunks from (tokenyard.services.gateway.senders),
and what the router may move (RouterHandler.place_again): pure logic with a scripted clock."""

from __future__ import annotations

from tokenyard.bus.nats import Bus
from tokenyard.fleet import FleetView
from tokenyard.routing.policy import PolicyConfig
from tokenyard.services.gateway.senders import RequestSenders
from tokenyard.services.router.handler import RouterHandler
from tokenyard.v1 import serving_pb2 as pb

PLACED = pb.Placement(prefill_worker_id="p1", decode_worker_id="d1")


def beat(worker: str, role: str = "both") -> pb.WorkerHeartbeat:
    return pb.WorkerHeartbeat(
        worker_id=worker, role=role, model="m", heartbeat_interval_ms=1000, max_num_seqs=4
    )


def fleet_of(*workers: str, at: float = 0.0) -> FleetView:
    fleet = FleetView()
    for w in workers:
        fleet.on_heartbeat(beat(w), at)
    return fleet


def chunk(index: int, text: str = "x", **fields) -> pb.TokenChunk:
    return pb.TokenChunk(request_id="r1", index=index, text=text, **fields)


def texts(chunks: list[pb.TokenChunk]) -> list[str]:
    return [c.text for c in chunks]


def test_only_the_placed_workers_chunks_pass_and_the_subject_names_the_sender():
    senders = RequestSenders("r1", PLACED, fleet_of("p1", "d1", "thief"))
    assert texts(senders.admit("p1", chunk(0, "a"))) == ["a"]
    (passed,) = senders.admit("d1", chunk(1, "b", worker_id="p1"))
    assert passed.worker_id == "d1"  # the payload's claim is overwritten by the subject's
    assert senders.admit("thief", chunk(2, "evil")) == []
    assert senders.admit(None, chunk(2, "no sender")) == []
    # A notice from a stranger adds nobody, itself included.
    assert senders.admit("thief", chunk(2, handed_to="thief")) == []
    assert "thief" not in senders.allowed


def test_a_hand_over_by_a_worker_of_the_request_lets_the_taker_in_with_what_it_sent_first():
    senders = RequestSenders("r1", PLACED, fleet_of("p1", "d1", "d2"))
    # The taker's first chunks can overtake the notice (another publisher): they wait.
    assert senders.admit("d2", chunk(3, "c")) == []
    assert texts(senders.admit("d1", chunk(3, handed_to="d2"))) == ["c"]
    assert texts(senders.admit("d2", chunk(4, "d"))) == ["d"]


def test_held_chunks_of_strangers_are_bounded():
    senders = RequestSenders("r1", PLACED, fleet_of("p1"), max_held=3)
    for i in range(10):
        senders.admit("thief", chunk(i))
    assert sum(len(v) for v in senders.held.values()) == 3


def test_a_move_is_believed_only_from_a_dead_worker_of_the_request_to_a_live_one():
    fleet = fleet_of("p1", "d1", "p2")
    senders = RequestSenders("r1", PLACED, fleet)
    assert senders.admit("p2", chunk(0, "a")) == []
    moved = pb.JobMoved(request_id="r1", from_worker_id="p1", to_worker_id="p2")
    # p1 is alive in this gateway's view: the move waits, p2's chunks with it.
    assert senders.on_moved(moved, now=1.0) == []
    assert senders.recheck(now=1.5) == []
    # Not a worker of the request: never believed, even once it is dead.
    stranger = pb.JobMoved(request_id="r1", from_worker_id="x9", to_worker_id="p2")
    assert senders.on_moved(stranger, now=1.0) == [] and senders.moves == [moved]
    # p1 falls silent (d1 and p2 still beat): now the move holds.
    fleet.on_heartbeat(beat("d1"), 9.0)
    fleet.on_heartbeat(beat("p2"), 9.0)
    assert texts(senders.recheck(now=9.5)) == ["a"]
    assert "p2" in senders.allowed and senders.moves == []


def test_a_move_to_a_dead_worker_is_not_believed():
    fleet = fleet_of("p1", "d1", "p2")
    fleet.on_heartbeat(beat("d1"), 9.0)  # p1 and p2 silent since 0
    senders = RequestSenders("r1", PLACED, fleet)
    moved = pb.JobMoved(request_id="r1", from_worker_id="p1", to_worker_id="p2")
    assert senders.on_moved(moved, now=9.5) == []
    assert "p2" not in senders.allowed


def test_the_router_moves_only_a_dead_workers_job_to_a_live_worker_as_the_same_request():
    now = [0.0]
    handler = RouterHandler(Bus.__new__(Bus), PolicyConfig(), clock=lambda: now[0])
    for w in ("p1", "p2"):
        handler.fleet.on_heartbeat(beat(w, "prefill"), 0.0)
    job = pb.PrefillJob(
        request_id="r1",
        model="m",
        prompt_token_ids=[1, 2, 3],
        params=pb.SamplingParams(max_tokens=7, seed=5),
        decode_worker_id="p1",
        gateway_id="gw",
    )
    assert handler.place_again(job, "p1") is None  # p1 is alive: its job stays its own
    now[0] = 5.0
    handler.fleet.on_heartbeat(beat("p2", "prefill"), 5.0)  # p1 silent since 0
    target, moved = handler.place_again(job, "p1")
    assert target == "p2"
    assert (moved.request_id, moved.gateway_id, list(moved.prompt_token_ids)) == (
        "r1",
        "gw",
        [1, 2, 3],
    )
    assert moved.params == job.params and moved.decode_worker_id == ""
    now[0] = 20.0  # p2 silent too: nobody to move it to
    assert handler.place_again(job, "p1") is None


class _Sub:
    subject = "ty.tokens.g.r1.>"


def _stream(fleet: FleetView, senders: RequestSenders):
    import asyncio

    from tokenyard.services.gateway.backend import NatsTokenStream
    from tokenyard.services.gateway.settings import GatewaySettings

    settings = GatewaySettings(dead_worker_grace_s=2, prefill_redelivery_grace_s=3)
    placement = pb.Placement(prefill_worker_id="p1")
    return NatsTokenStream([_Sub()], asyncio.Queue(), placement, fleet, settings,  # type: ignore[list-item]
                           senders=senders)  # fmt: skip


async def test_a_request_whose_job_moved_waits_on_its_new_worker_past_the_loss_grace():
    import time

    import pytest

    from tokenyard.api_errors import ApiError

    t0 = time.monotonic()
    placed = pb.Placement(prefill_worker_id="p1")
    for moved in (False, True):
        fleet = fleet_of("p1", "p2", at=t0)
        senders = RequestSenders("r1", placed, fleet)
        stream = _stream(fleet, senders)
        fleet.on_heartbeat(beat("p2"), t0 + 5)  # p1 fell silent: lost at t0 + 5
        await stream._check_stall(t0 + 5)
        if moved:  # the router placed its job on p2, which queues it behind others
            move = pb.JobMoved(request_id="r1", from_worker_id="p1", to_worker_id="p2")
            assert senders.on_moved(move, t0 + 5) == []
        for t in (t0 + 6, t0 + 8, t0 + 10):  # p2 stays alive, its queue long
            fleet.on_heartbeat(beat("p2"), t)
        if not moved:  # the grace (3 s) runs out: refused
            with pytest.raises(ApiError) as lost:
                await stream._check_stall(t0 + 10)
            assert lost.value.code == "worker_lost"
            continue
        await stream._check_stall(t0 + 10)  # waits: its job is queued on a live worker
        assert stream._worker == "p2"
        # p2 dies too before the first token (silent since t0 + 10): lost again, and the
        # grace counts from this loss
        await stream._check_stall(t0 + 14)
        with pytest.raises(ApiError):
            await stream._check_stall(t0 + 18)
