"""`tokenyard up --autoscale`'s controller: heartbeats into the policy's signals, and its
decisions carried out on the stack (a recording stand-in for the processes)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenyard.autoscale.policy import AutoscaleSettings
from tokenyard.services.launch.autoscaler import Heard, StackAutoscaler, signals_from
from tokenyard.v1 import serving_pb2 as pb


def _heard(wid: str, role: str, running: int, waiting: int = 0, at: float = 100.0) -> Heard:
    hb = pb.WorkerHeartbeat(worker_id=wid, role=role, num_running=running,
                            num_waiting=waiting, max_num_seqs=8)  # fmt: skip
    return Heard(hb, at)


def test_signals_from_heartbeats_and_the_launchers_records():
    heard = {"prefill-1": _heard("prefill-1", "prefill", 2), "decode-2": _heard("decode-2", "decode", 4, 3),
             "decode-3": _heard("decode-3", "decode", 1, at=90.0)}  # fmt: skip
    procs = {
        "prefill-1": "prefill",
        "decode-2": "decode",
        "decode-3": "decode",
        "decode-4": "decode",
    }
    sig = signals_from(heard, procs, {"decode-5"}, max_workers=4, now=101.0)
    by = {w.worker_id: w for w in sig.workers}
    assert by["prefill-1"].busy == 0.25 and not by["prefill-1"].starting
    assert by["decode-2"].busy == 0.5 and by["decode-2"].queued == 3
    assert by["decode-3"].starting  # silent for 11 s: not counted as serving capacity
    assert by["decode-4"].starting  # never heard: loading its model
    assert "decode-5" not in by  # retiring: no longer the launcher's worker
    assert len(sig.racks[0].free_nodes) == 8 - 4 - 1


@dataclass
class FakeProc:
    name: str
    running: bool = True
    proc: object = None

    def alive(self) -> bool:
        return self.running


class FakeStack:
    def __init__(self) -> None:
        self.workers = [FakeProc("prefill-1"), FakeProc("decode-2")]
        self.roles = {"prefill-1": "prefill", "decode-2": "decode"}
        self.retired: list[FakeProc] = []

    def worker_role(self, proc: FakeProc) -> str:
        return self.roles[proc.name]

    def add_worker(self, role: str) -> FakeProc:
        proc = FakeProc(f"{role}-{len(self.roles) + 1}")
        self.workers.append(proc)
        self.roles[proc.name] = role
        return proc

    def retire_worker(self, wid: str) -> FakeProc:
        proc = next(p for p in self.workers if p.name == wid)
        self.workers.remove(proc)
        self.retired.append(proc)
        return proc


class FakeWatch:
    def __init__(self) -> None:
        self.heard: dict[str, Heard] = {}

    def latest(self) -> dict[str, Heard]:
        return dict(self.heard)


def test_the_controller_starts_on_load_and_retires_after_it_falls():
    stack, watch = FakeStack(), FakeWatch()
    settings = AutoscaleSettings(mode="sla", down_after_s=10, down_cooldown_s=20,
                                 max_workers={"prefill": 3, "decode": 3})  # fmt: skip
    scaler = StackAutoscaler(stack, watch, settings, interval_s=5)  # type: ignore[arg-type]
    watch.heard = {"prefill-1": _heard("prefill-1", "prefill", 1, at=0),
                   "decode-2": _heard("decode-2", "decode", 8, 4, at=0)}  # fmt: skip
    decision = scaler.tick(now=0.0)
    assert decision is not None and [s.role for s in decision.start] == ["decode", "decode"]
    assert [p.name for p in stack.workers] == ["prefill-1", "decode-2", "decode-3", "decode-4"]
    assert scaler.tick(now=1.0) is None  # not yet the next interval
    # the load falls: every decoder idle, heard at each tick
    for t in (5.0, 10.0, 15.0, 20.0, 25.0):
        watch.heard = {p.name: _heard(p.name, stack.roles[p.name], 0, at=t) for p in stack.workers}
        scaler.tick(now=t)
    assert [p.name for p in stack.retired] == ["decode-2"]
    assert "decode-2" in scaler.retiring
    stack.retired[0].running = False  # its graceful stop ended
    scaler.tick(now=26.0)
    assert scaler.retiring == {}


def test_a_retired_worker_is_neither_restarted_nor_an_error(tmp_path):
    from tokenyard.services.launch.group import ServiceGroup
    from tokenyard.services.launch.supervise import RestartPolicy

    group = ServiceGroup(RestartPolicy(), tmp_path)
    gone = FakeProc("decode-2", running=False)
    group.procs.append(gone)  # type: ignore[arg-type]
    group.retire(gone)  # type: ignore[arg-type]
    assert group.supervise() == []
    group.check_alive()  # no StackError: it stopped on purpose
