"""The one resume loop (tokenyard.fleet.resume): candidates best first, a failed or refused
offer moves on to the next, the first taker ends it. A scripted bus; no NATS."""

from __future__ import annotations

from tokenyard.bus import subjects
from tokenyard.fleet import FleetView
from tokenyard.fleet.resume import resume_on_live_worker
from tokenyard.v1 import serving_pb2 as pb


class ScriptedBus:
    """Answers each worker's hand-off subject as scripted: True/False accepts/refuses, an
    exception is raised (gone, timed out)."""

    def __init__(self, answers: dict[str, bool | Exception]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, float]] = []

    async def request(self, subject, message, reply_type, timeout):
        worker_id = next(w for w in self.answers if subjects.decode_jobs(w) == subject)
        self.asked.append((worker_id, timeout))
        answer = self.answers[worker_id]
        if isinstance(answer, Exception):
            raise answer
        assert isinstance(message, pb.DecodeHandoff) and reply_type is pb.HandoffAck
        return pb.HandoffAck(request_id=message.request_id, accepted=answer, message="full")


def live_fleet() -> FleetView:
    fleet = FleetView(missed_heartbeats=3)
    for worker_id, role, running in [
        ("dead", "decode", 0),
        ("d-idle", "decode", 0),
        ("d-busy", "decode", 5),
        ("p", "prefill", 0),
    ]:
        beat = pb.WorkerHeartbeat(
            worker_id=worker_id,
            role=role,
            model="m",
            heartbeat_interval_ms=1000,
            num_running=running,
            num_free_blocks=100,
            num_blocks=100,
        )
        fleet.on_heartbeat(beat, now=0.0)
    return fleet


RESUME = pb.DecodeHandoff(request_id="r1", output_token_ids=[4, 5, 6], gateway_id="gw")


async def test_failed_and_refused_offers_move_on_to_the_next_candidate():
    bus = ScriptedBus({"d-idle": TimeoutError(), "d-busy": False, "p": True, "dead": True})
    taker = await resume_on_live_worker(
        bus, live_fleet().live(1.0), RESUME, exclude="dead", timeout_s=2.5
    )
    assert taker == "p"
    assert bus.asked == [("d-idle", 2.5), ("d-busy", 2.5), ("p", 2.5)]  # never the dead one


async def test_the_first_taker_ends_the_loop():
    bus = ScriptedBus({"d-idle": True, "d-busy": True, "p": True, "dead": True})
    taker = await resume_on_live_worker(
        bus, live_fleet().live(1.0), RESUME, exclude="dead", timeout_s=1.0
    )
    assert taker == "d-idle" and [w for w, _ in bus.asked] == ["d-idle"]


async def test_nobody_takes_it():
    bus = ScriptedBus({"d-idle": False, "d-busy": RuntimeError("gone"), "p": False, "dead": True})
    taker = await resume_on_live_worker(
        bus, live_fleet().live(1.0), RESUME, exclude="dead", timeout_s=1.0
    )
    assert taker is None and len(bus.asked) == 3
