"""Drives a workload against a server: closed loop at a fixed concurrency, or open loop
with Poisson arrivals, after an excluded warm-up. Also meters the client itself (CPU
time, event-loop lag, late sends) so a reader can tell the client was not the bottleneck.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tokenyard.bench import metrics
from tokenyard.bench.arrivals import poisson_arrivals
from tokenyard.bench.client import Target, stream_request
from tokenyard.bench.records import RequestRecord, TokenCounter, make_record
from tokenyard.bench.workloads import Conversation, Session

KEEPALIVE_S = 2.0  # seconds an idle client connection is kept

LOOP_PROBE_S = 0.05  # how often the event-loop lag probe wakes (each wake-up costs CPU too)


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # closed loop: this many requests always in flight
    request_rate: float | None = None  # open loop: Poisson arrivals, requests/s (inf: all at once)
    max_concurrency: int | None = None  # open loop: cap on requests in flight

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load is either a concurrency (closed) or a request rate (open)")

    @property
    def label(self) -> str:
        if self.request_rate is None:
            return f"concurrency={self.concurrency}"
        cap = f" cap={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={self.request_rate:g}{cap}"

    @property
    def pool_size(self) -> int | None:
        return self.concurrency if self.request_rate is None else self.max_concurrency


@dataclass
class RunResult:
    load: Load
    records: list[RequestRecord]  # warm-up included, flagged
    client: dict = field(default_factory=dict)


class _Sender:
    """Sends sessions turn by turn and keeps their records (shared by both load shapes)."""

    def __init__(
        self,
        target: Target,
        http: httpx.AsyncClient,
        t0_ns: int,
        on_done: Callable[[RequestRecord], None] | None,
    ) -> None:
        self.target, self.http, self.t0_ns, self.on_done = target, http, t0_ns, on_done
        self.records: list[RequestRecord] = []
        self.untokenized: list[tuple[RequestRecord, str, str]] = []  # no usage: count later
        self.chunks = 0
        self._index = itertools.count()

    async def run(
        self, sid: int, session: Session, *, warmup: bool = False, scheduled_ns: int | None = None
    ) -> None:
        conversation = Conversation(session)
        for turn in itertools.count():
            if conversation.done():
                return
            messages, max_tokens = conversation.next_request()
            index = next(self._index)
            ex = await stream_request(self.http, self.target, messages, max_tokens)
            record = make_record(
                ex, t0_ns=self.t0_ns, index=index, session=sid, turn=turn,
                max_tokens=max_tokens, warmup=warmup, scheduled_ns=scheduled_ns,
            )  # fmt: skip
            scheduled_ns = None  # later turns follow the reply, not the arrival process
            self.records.append(record)
            self.chunks += len(ex.chunk_ns)
            if ex.usage is None:
                prompt = "\n".join(m["content"] for m in messages)
                self.untokenized.append((record, prompt, ex.output_text))
            if self.on_done and not warmup:
                self.on_done(record)
            if not ex.ok:
                return  # NOTE: the next turn needs this reply; the rest of the session is dropped
            conversation.add_reply(ex.output_text)


async def _closed(sender: _Sender, sessions: list[Session], concurrency: int, **kw) -> None:
    queue = deque(enumerate(sessions))

    async def worker() -> None:
        while queue:
            sid, session = queue.popleft()
            await sender.run(sid, session, **kw)

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(concurrency, len(sessions))):
            tg.create_task(worker())


async def _open(sender: _Sender, sessions: list[Session], load: Load, seed: int) -> None:
    assert load.request_rate is not None
    offsets = poisson_arrivals(load.request_rate, len(sessions), random.Random(seed))
    slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def one(sid: int, session: Session, at_ns: int) -> None:
        if slots is None:
            await sender.run(sid, session, scheduled_ns=at_ns)
            return
        async with slots:  # with a cap, the send lag includes the wait for a slot
            await sender.run(sid, session, scheduled_ns=at_ns)

    start = time.perf_counter_ns()
    async with asyncio.TaskGroup() as tg:
        for (sid, session), offset in zip(enumerate(sessions), offsets, strict=True):
            at_ns = start + int(offset * 1e9)
            delay = (at_ns - time.perf_counter_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)
            tg.create_task(one(sid, session, at_ns))


async def _probe_loop(lags_ms: list[float]) -> None:
    """How late the event loop wakes: a busy client shows here before anywhere else."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LOOP_PROBE_S)
        lags_ms.append((time.perf_counter() - t - LOOP_PROBE_S) * 1e3)


async def run_load(
    target: Target,
    sessions: list[Session],
    load: Load,
    *,
    warmup: list[Session] | None = None,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
    counter: TokenCounter | None = None,
) -> RunResult:
    pool = load.pool_size
    # NOTE: idle connections are dropped after 2 s, before a server's own keep-alive timeout
    # (5 s in uvicorn and llama.cpp's server): a request sent on a connection the server is
    # closing fails with "Server disconnected without sending a response".
    limits = httpx.Limits(
        max_connections=pool, max_keepalive_connections=pool, keepalive_expiry=KEEPALIVE_S
    )
    timeout = httpx.Timeout(target.timeout_s, connect=10.0, pool=None)
    # NOTE: trust_env=False: a proxy from the environment would sit inside every timing.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as http:
        sender = _Sender(target, http, time.perf_counter_ns(), on_done)
        if warmup:
            await _closed(
                sender, warmup, load.concurrency or load.max_concurrency or 1, warmup=True
            )
        chunks0, cpu0, wall0 = sender.chunks, time.process_time(), time.perf_counter()
        lags_ms: list[float] = []
        probe = asyncio.create_task(_probe_loop(lags_ms))
        try:
            if load.request_rate is None:
                assert load.concurrency is not None
                await _closed(sender, sessions, load.concurrency)
            else:
                await _open(sender, sessions, load, seed)
        finally:
            probe.cancel()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    counter = counter or TokenCounter()
    for record, prompt, output in sender.untokenized:
        counter.fill(record, prompt, output)
    measured = [r for r in sender.records if not r.warmup]
    chunks = sender.chunks - chunks0
    client = _client_overhead(measured, cpu_s, wall_s, chunks, lags_ms)
    return RunResult(load, sorted(sender.records, key=lambda r: r.index), client)


def _client_overhead(
    measured: list[RequestRecord], cpu_s: float, wall_s: float, chunks: int, lags_ms: list[float]
) -> dict:
    lags = [r.send_lag_ms for r in measured if r.send_lag_ms is not None]
    return {
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "cpu_util": cpu_s / wall_s if wall_s > 0 else math.nan,  # of one core
        "cpu_ms_per_request": 1e3 * cpu_s / len(measured) if measured else None,
        "cpu_us_per_chunk": 1e6 * cpu_s / chunks if chunks else None,
        "chunks": chunks,
        "loop_lag_ms": metrics.stats(lags_ms),
        "send_lag_ms": metrics.stats(lags),
    }
