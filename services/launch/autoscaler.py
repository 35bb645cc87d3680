"""`tokenyard up --autoscale`: the autoscaler's decisions (`tokenyard.autoscale.policy`)
carried out on the local stack's worker processes.

A thread listens to the workers' heartbeats on NATS (`HeartbeatWatch`); the launcher's
main loop calls `StackAutoscaler.tick` (children are only started from that thread: a
child's parent-death signal follows the thread that started it). A start is
`LocalStack.add_worker(role)`. A stop is the worker's own graceful stop (SIGTERM): it takes
no new work, finishes what it runs, hands back what does not finish within its drain
timeout, and exits; the launcher stops supervising it first, so it is not restarted.

The local stack has one site and no rack budgets of its own: it scales in `sla` mode with
every worker on one rack, `local`, of `max_workers` x 2 nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenyard.autoscale.policy import (
    AutoscaleSettings,
    Decision,
    RackSignal,
    ScalerState,
    Signals,
    WorkerSignal,
    decide,
)
from tokenyard.bus import subjects
from tokenyard.v1 import serving_pb2 as pb

if TYPE_CHECKING:
    from tokenyard.services.launch.procs import ChildProcess
    from tokenyard.services.launch.stack import LocalStack

log = logging.getLogger(__name__)

LOCAL_RACK = "local"


@dataclass(frozen=True)
class Heard:
    heartbeat: pb.WorkerHeartbeat
    at: float  # time.monotonic() on arrival


class HeartbeatWatch:
    """The latest heartbeat of every worker, kept by a thread of its own."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self._latest: dict[str, Heard] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="autoscale-heartbeats", daemon=True)

    def start(self, timeout: float = 10.0) -> HeartbeatWatch:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the autoscaler could not subscribe to heartbeats on NATS")
        return self

    def latest(self) -> dict[str, Heard]:
        with self._lock:
            return dict(self._latest)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        asyncio.run(self._listen())

    async def _listen(self) -> None:
        import nats

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(self.nats_url)

        async def on_beat(msg) -> None:  # noqa: ANN001 (nats-py's Msg)
            hb = pb.WorkerHeartbeat.FromString(msg.data)
            with self._lock:
                self._latest[hb.worker_id] = Heard(hb, time.monotonic())

        try:
            await nc.subscribe(subjects.HEARTBEATS_ALL, cb=on_beat)
            await nc.flush()
            self._ready.set()
            await self._stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await nc.drain()


def signals_from(
    heard: dict[str, Heard],
    procs: dict[str, str],
    retiring: set[str],
    max_workers: int,
    now: float,
    stale_s: float = 3.0,
) -> Signals:
    """What the policy reads, from the heartbeats and the launcher's own records.

    `procs`: worker id -> role of every worker process the launcher runs (not retiring);
    one not heard from recently is still starting (loading its model)."""
    workers = []
    for wid, role in sorted(procs.items()):
        beat = heard.get(wid)
        fresh = beat is not None and now - beat.at <= stale_s
        hb = beat.heartbeat if fresh and beat is not None else None
        seqs = hb.max_num_seqs if hb is not None and hb.max_num_seqs else 1
        workers.append(
            WorkerSignal(
                wid,
                role,
                LOCAL_RACK,
                busy=(hb.num_running / seqs) if hb is not None else 0.0,
                queued=hb.num_waiting if hb is not None else 0,
                max_num_seqs=seqs,
                starting=hb is None or bool(hb.not_ready),
                draining=wid in retiring,
            )
        )
    slots = max(0, 2 * max_workers - len(procs) - len(retiring))
    rack = RackSignal(LOCAL_RACK, float("inf"), 0.0, tuple(f"slot-{i}" for i in range(slots)))
    return Signals(now, tuple(workers), (rack,))


class StackAutoscaler:
    def __init__(
        self,
        stack: LocalStack,
        watch: HeartbeatWatch,
        settings: AutoscaleSettings,
        interval_s: float = 5.0,
    ) -> None:
        self.stack, self.watch, self.settings = stack, watch, settings
        self.interval_s = interval_s
        self.state = ScalerState()
        self.retiring: dict[str, ChildProcess] = {}
        self.next_at = 0.0
        self.max_workers = max(settings.max_workers.values())

    def tick(self, now: float | None = None) -> Decision | None:
        """Reap workers that finished their drain; every interval, decide and act."""
        now = time.monotonic() if now is None else now
        for wid, proc in list(self.retiring.items()):
            if not proc.alive():
                code = proc.proc.returncode if proc.proc else None
                log.warning("autoscaler: %s drained and stopped (exit %s)", wid, code)
                del self.retiring[wid]
        if now < self.next_at:
            return None
        self.next_at = now + self.interval_s
        procs = {p.name: self.stack.worker_role(p) for p in self.stack.workers}
        signals = signals_from(
            self.watch.latest(), procs, set(self.retiring), self.max_workers, now
        )
        decision = decide(signals, self.state, self.settings)
        for start in decision.start:
            proc = self.stack.add_worker(start.role)
            log.warning("autoscaler: started %s (%s)", proc.name, "; ".join(decision.reasons))
        for wid in decision.drain:
            self.retiring[wid] = self.stack.retire_worker(wid)
            log.warning("autoscaler: draining %s (%s)", wid, "; ".join(decision.reasons))
        return decision
