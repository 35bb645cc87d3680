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


def _page(ttft: dict[float, int], itl: dict[float, int], worker: str = "w") -> str:
    """A worker's /metrics page with the two histograms (cumulative counts by bound)."""
    lines = []
    for name, buckets in (("tokenyard:time_to_first_token_seconds", ttft),
                          ("tokenyard:inter_token_latency_seconds", itl)):  # fmt: skip
        lines.append(f"# TYPE {name} histogram")
        for le, count in buckets.items():
            le_text = "+Inf" if le == float("inf") else str(le)
            lines.append(f'{name}_bucket{{worker="{worker}",le="{le_text}"}} {count}')
        lines.append(f'{name}_count{{worker="{worker}"}} {max(buckets.values())}')
    return "\n".join(lines) + "\n"


INF = float("inf")


def test_quantile_interpolates_within_its_bucket_as_prometheus_does():
    from tokenyard.services.launch.autoscaler import quantile

    assert quantile({0.5: 0, 1.0: 100, INF: 100}, 0.99) == 0.5 + 0.5 * 0.99
    assert quantile({1.0: 50, 2.5: 100, INF: 100}, 0.5) == 1.0
    assert quantile({1.0: 0, 2.5: 0, INF: 10}, 0.99) == 2.5  # past the last bound
    assert quantile({1.0: 0, INF: 0}, 0.99) is None


def test_the_latency_window_takes_what_the_workers_observed_since_the_last_sample():
    from tokenyard.services.launch.autoscaler import LatencyWindow

    pages: dict[str, str] = {}
    window = LatencyWindow(fetch=lambda endpoint: pages[endpoint])
    pages["p:1"] = _page({1.0: 10, 2.5: 10, 5.0: 10, INF: 10}, {0.05: 0, 0.1: 0, INF: 0})
    pages["d:2"] = _page({1.0: 0, 2.5: 0, 5.0: 0, INF: 0}, {0.05: 90, 0.1: 100, INF: 100})
    endpoints = {"prefill-1": "p:1", "decode-2": "d:2"}
    assert window.sample(endpoints) == (None, None)  # first sight: the baseline only
    # the next interval: 10 more first tokens, all in (2.5, 5]; ITL: 100 more, in (0.05, 0.1]
    pages["p:1"] = _page({1.0: 10, 2.5: 10, 5.0: 20, INF: 20}, {0.05: 0, 0.1: 0, INF: 0})
    pages["d:2"] = _page({1.0: 0, 2.5: 0, 5.0: 0, INF: 0}, {0.05: 90, 0.1: 200, INF: 200})
    ttft, itl = window.sample(endpoints)
    assert ttft is not None and 4.9 < ttft <= 5.0  # not the earlier fast ones
    assert itl is not None and 0.09 < itl <= 0.1
    assert window.sample(endpoints) == (None, None)  # nothing new since

    del pages["d:2"]  # one not answering adds nothing; the other still counts
    pages["p:1"] = _page({1.0: 20, 2.5: 20, 5.0: 30, INF: 30}, {0.05: 0, 0.1: 0, INF: 0})
    ttft, itl = window.sample(endpoints)
    assert ttft is not None and 0.9 < ttft <= 1.0 and itl is None


def test_the_controllers_signals_carry_the_intervals_percentiles_to_the_policy():
    from tokenyard.services.launch.autoscaler import LatencyWindow

    stack, watch = FakeStack(), FakeWatch()
    settings = AutoscaleSettings(mode="sla", ttft_p99_s=2.0, itl_p99_s=0.1,
                                 max_workers={"prefill": 3, "decode": 3})  # fmt: skip
    pages = {"p:1": _page({1.0: 0, 5.0: 0, INF: 0}, {0.1: 0, INF: 0}),
             "d:2": _page({1.0: 0, 5.0: 0, INF: 0}, {0.1: 0, INF: 0})}  # fmt: skip
    latency = LatencyWindow(fetch=lambda endpoint: pages[endpoint])
    scaler = StackAutoscaler(stack, watch, settings, interval_s=5, latency=latency)  # type: ignore[arg-type]

    def beat(t: float) -> None:
        watch.heard = {}
        for p in stack.workers:
            hb = pb.WorkerHeartbeat(worker_id=p.name, role=stack.roles[p.name], max_num_seqs=8,
                                    ops_endpoint="p:1" if p.name == "prefill-1" else "d:2")  # fmt: skip
            watch.heard[p.name] = Heard(hb, t)

    beat(0.0)
    assert scaler.tick(now=0.0) is not None
    # idle by busy share, but first tokens took 3-5 s in the interval: a prefill is added
    pages["p:1"] = _page({1.0: 0, 5.0: 40, INF: 40}, {0.1: 0, INF: 0})
    beat(5.0)
    decision = scaler.tick(now=5.0)
    assert decision is not None and scaler.last_signals is not None
    assert scaler.last_signals.ttft_p99_s is not None and scaler.last_signals.ttft_p99_s > 2.0
    assert scaler.last_signals.itl_p99_s is None
    assert [s.role for s in decision.start] == ["prefill"]
    assert any("SLO missed" in r for r in decision.reasons)
