"""`tokenyard up --autoscale`: the autoscaler's decisions (`tokenyard.autoscale.policy`)
carried out on the local stack's worker processes.

A thread listens to the workers' heartbeats on NATS (`HeartbeatWatch`); the launcher's
main loop calls `StackAutoscaler.tick` (children are only started from that thread: a
child's parent-death signal follows the thread that started it). A start is
`LocalStack.add_worker(role)`. A stop is the worker's own graceful stop (SIGTERM): it takes
no new work, finishes what it runs, hands back what does not finish within its drain
timeout, and exits; the launcher stops supervising it first, so it is not restarted.

The SLO inputs (`Signals.ttft_p99_s`, `itl_p99_s`) are the p99 over the last interval of
the workers' own latency histograms (`LatencyWindow`): each live worker's ops /metrics
(its heartbeat names the address), the observations added since the previous scrape.

The local stack has one site and no rack budgets of its own: it scales in `sla` mode with
every worker on one rack, `local`, of `max_workers` x 2 nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

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
# The workers' histograms (tokenyard.services.worker.metrics): TTFT from the request's
# arrival at the gateway to its first token, queueing included; ITL between two steps.
TTFT_METRIC = "tokenyard:time_to_first_token_seconds"
ITL_METRIC = "tokenyard:inter_token_latency_seconds"
SCRAPE_TIMEOUT_S = 2.0
STALE_S = 3.0  # a worker not heard from this long is starting (or gone)

Buckets = dict[float, float]  # a histogram's upper bound (le, inf included) -> count


def histograms(text: str, names: Iterable[str]) -> dict[str, Buckets]:
    """The cumulative buckets of each named histogram in a Prometheus text page, summed
    over its label sets."""
    wanted = set(names)
    out: dict[str, Buckets] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        buckets = out.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name == family.name + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return out


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile of cumulative buckets, interpolated within its bucket as Prometheus's
    histogram_quantile does (the largest finite bound when it falls past it); None: empty."""
    bounds = sorted(buckets)
    total = buckets.get(math.inf, buckets[bounds[-1]] if bounds else 0.0)
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _scrape(endpoint: str) -> str:
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=SCRAPE_TIMEOUT_S) as r:
        return str(r.read().decode())


class LatencyWindow:
    """TTFT and ITL p99 over the observations the workers made since the last `sample`."""

    def __init__(self, fetch: Callable[[str], str] = _scrape, q: float = 0.99) -> None:
        self.fetch, self.q = fetch, q
        self._last: dict[str, dict[str, Buckets]] = {}  # worker id -> its cumulative buckets

    def sample(self, endpoints: dict[str, str]) -> tuple[float | None, float | None]:
        """`endpoints`: worker id -> its ops address. A worker first seen only sets its
        baseline; one that does not answer adds nothing this time."""
        added: dict[str, Buckets] = {TTFT_METRIC: {}, ITL_METRIC: {}}
        for wid, endpoint in endpoints.items():
            try:
                now = histograms(self.fetch(endpoint), added)
            except Exception as exc:  # a worker busy or stopping: the next scrape counts it
                log.debug("autoscaler: no metrics from %s: %s", wid, exc)
                continue
            before = self._last.get(wid)
            self._last[wid] = now
            if before is None:
                continue
            for name, cumulative in now.items():
                prev = before.get(name, {})
                if cumulative.get(math.inf, 0.0) < prev.get(math.inf, 0.0):
                    prev = {}  # restarted under the same id: all of it is new
                into = added[name]
                for le, count in cumulative.items():
                    into[le] = into.get(le, 0.0) + count - prev.get(le, 0.0)
        for gone in set(self._last) - set(endpoints):
            del self._last[gone]
        return quantile(added[TTFT_METRIC], self.q), quantile(added[ITL_METRIC], self.q)


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
    stale_s: float = STALE_S,
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
        latency: LatencyWindow | None = None,
    ) -> None:
        self.stack, self.watch, self.settings = stack, watch, settings
        self.latency = latency  # None: no SLO inputs (the policy scales on load alone)
        self.last_signals: Signals | None = None
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
        heard = self.watch.latest()
        signals = signals_from(heard, procs, set(self.retiring), self.max_workers, now)
        if self.latency is not None:
            endpoints = {
                wid: h.heartbeat.ops_endpoint
                for wid, h in heard.items()
                if h.heartbeat.ops_endpoint and now - h.at <= STALE_S
            }
            ttft, itl = self.latency.sample(endpoints)
            signals = dataclasses.replace(signals, ttft_p99_s=ttft, itl_p99_s=itl)
        self.last_signals = signals
        decision = decide(signals, self.state, self.settings)
        why = "; ".join(decision.reasons) + slo_note(signals)
        for start in decision.start:
            proc = self.stack.add_worker(start.role)
            log.warning("autoscaler: started %s (%s)", proc.name, why)
        for wid in decision.drain:
            self.retiring[wid] = self.stack.retire_worker(wid)
            log.warning("autoscaler: draining %s (%s)", wid, why)
        return decision


def slo_note(signals: Signals) -> str:
    """ "; TTFT p99 1.20 s, ITL p99 0.045 s" (the last interval's), or "" without them."""
    parts = [
        f"{name} p99 {value:.3f} s"
        for name, value in (("TTFT", signals.ttft_p99_s), ("ITL", signals.itl_p99_s))
        if value is not None
    ]
    return "; " + ", ".join(parts) if parts else ""
