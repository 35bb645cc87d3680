"""The requests running on this worker: their token streams, and what can happen to them
from outside (a cancel, a replay, a redelivered job, the admission cap they wait under).

Every role runs its requests through one :class:`Streams`; the engine calls they need
(abort) go through the worker's EngineLoop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from tokenyard.bus.nats import Bus
from tokenyard.services.worker.admission import AdmissionGate
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.metrics import WorkerMetrics
from tokenyard.services.worker.stream import HANDED_BACK, TokenStream
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

CANCELLED_TTL_S = 300.0  # remember cancelled ids this long (their job may still be queued)
# Keep an ended stream's chunks this long for a gateway that missed some (Replay).
REPLAY_TTL_S = 60.0


class Streams:
    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        loop: EngineLoop,
        gate: AdmissionGate,
        metrics: WorkerMetrics,
        decode_text: Callable[[list[int]], str],
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.loop = loop
        self.gate = gate
        self.metrics = metrics
        self.decode_text = decode_text
        self.running: dict[str, TokenStream] = {}
        self.ended: dict[str, tuple[float, TokenStream]] = {}  # for replays, REPLAY_TTL_S
        self.cancelled: dict[str, float] = {}
        # request id -> outcome of the job running here (True done, False handed back,
        # None failed): a redelivered copy of it waits for that instead of running twice.
        self.jobs: dict[str, asyncio.Future[bool | None]] = {}

    def open(
        self,
        request_id: str,
        gateway_id: str,
        *,
        start_index: int = 0,
        cached_tokens: int | None = None,
        arrival_unix_ns: int = 0,
    ) -> TokenStream:
        """A new stream for a request starting (or continuing, from ``start_index``) here."""
        stream = TokenStream(
            self.bus,
            self.worker_id,
            gateway_id,
            request_id,
            self.decode_text,
            start_index=start_index,
            cached_tokens=cached_tokens,
            timer=self.metrics.timer(
                first_token_here=start_index == 0, arrival_unix_ns=arrival_unix_ns
            ),
        )
        self.running[request_id] = stream
        stream.done.add_done_callback(lambda _: self._ended(stream))
        return stream

    def discard(self, stream: TokenStream) -> None:
        """Forget a stream that never started (its import failed): nothing was sent on it."""
        if self.running.get(stream.request_id) is stream:
            del self.running[stream.request_id]
        stream.hand_back()

    def _ended(self, stream: TokenStream) -> None:
        request_id = stream.request_id
        if self.running.get(request_id) is stream:  # not a newer stream of the same request
            del self.running[request_id]
        if not stream.sent:
            return  # nothing to replay; keep an earlier stream's chunks (its prefill's)
        now = time.monotonic()
        self.ended.pop(request_id, None)  # to the end of the insertion order
        self.ended[request_id] = (now, stream)
        while self.ended:  # oldest first: dicts keep insertion order
            rid, (at, _) = next(iter(self.ended.items()))
            if now - at <= REPLAY_TTL_S:
                break
            del self.ended[rid]

    def finished_here(self, request_id: str) -> bool:
        """The request ran to its end here lately (a late redelivery of its job has no more to do)."""
        ended = self.ended.get(request_id)
        return ended is not None and ended[1].done.result() not in ("prefilled", HANDED_BACK)

    def busy(self) -> bool:
        """Requests running here, or jobs being worked on."""
        return bool(self.running or self.jobs)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait for in-flight requests to finish; False if some are still running."""
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.running

    async def hand_back_waiting(self) -> int:
        """Hand back every work-queue job queued here that has not begun (a stopping
        worker's queue goes on elsewhere at once, not after its drain); how many."""
        handed = 0
        for rid, stream in list(self.running.items()):
            if not stream.from_job or stream.sent or stream.done.done():
                continue
            if await self.loop.abort_if_waiting(rid):
                stream.hand_back()
                handed += 1
        return handed

    async def hand_back_all(self) -> None:
        """Stop every request still running here without ending it for the client."""
        for rid, stream in list(self.running.items()):
            await self.loop.abort(rid)
            stream.hand_back()

    # --- admission: the facilities cap and redelivered jobs -----------------------------

    async def admit(
        self, stream: TokenStream, params: pb.SamplingParams | None = None, tokens: int = 0
    ) -> bool:
        """Wait for room under the cap (in turn by `params`' priority and tenant; `tokens`:
        what the request may be served); the place is held until the stream ends."""
        if params is None:
            await self.gate.acquire()
        else:
            await self.gate.acquire(params.priority, params.tenant, tokens)
        if stream.done.done():
            self.gate.release()
            return False
        stream.done.add_done_callback(lambda _: self.gate.release())
        return True

    async def run_once(self, request_id: str, run: Callable[[], Awaitable[bool]]) -> bool:
        """Run a job unless it already runs here (JetStream redelivered it to us, e.g. while
        a slow hand-off kept it unacked): the copy then waits for the running one and gets
        its outcome, so it is acked with it instead of being added to the engine again."""
        running = self.jobs.get(request_id)
        while running is not None:
            log.info("job %s is already running here; waiting for it", request_id)
            earlier = await asyncio.shield(running)
            if earlier is not None:
                return earlier
            running = self.jobs.get(request_id)  # it failed: this delivery is the retry
        outcome_f: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()
        self.jobs[request_id] = outcome_f
        outcome: bool | None = None
        try:
            outcome = await run()
            return outcome
        finally:
            del self.jobs[request_id]
            outcome_f.set_result(outcome)

    # --- cancel and replay --------------------------------------------------------------

    async def on_cancel(self, cancel: pb.Cancel, _msg: Msg | None) -> None:
        rid = cancel.request_id
        now = time.monotonic()
        self.cancelled[rid] = now
        for old in [r for r, t in self.cancelled.items() if now - t > CANCELLED_TTL_S]:
            del self.cancelled[old]
        stream = self.running.get(rid)
        if stream is None:
            return
        await self.abort(stream)
        log.info("cancelled %s (%s)", rid, cancel.reason or "no reason")

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled

    async def abort(self, stream: TokenStream) -> None:
        """Stop a cancelled request in the engine and end its stream for the client."""
        await self.loop.abort(stream.request_id)
        await stream.aborted()

    async def on_replay(self, replay: pb.Replay, _msg: Msg | None) -> None:
        rid = replay.request_id
        # Both, when this worker ran the request twice (its prefill, then its decode).
        streams = [self.running.get(rid)]
        if rid in self.ended:
            streams.append(self.ended[rid][1])
        sent = 0
        for stream in streams:
            if stream is not None:
                sent += await stream.replay(replay.from_index)
        if sent:
            log.info("replayed %d chunks of %s from index %d", sent, rid, replay.from_index)
