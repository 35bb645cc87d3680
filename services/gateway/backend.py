"""The gateway's side of the serving path on NATS: route, enqueue, stream the tokens back, cancel.

    stream = await backend.submit(rid, model, prompt_ids, params)  # raises ApiError (503, ...)
    async for chunk in stream: ...                                 # ordered TokenChunks
    await backend.cancel(rid, "client disconnected")               # all the way down

The token subscription opens BEFORE the route request so that no chunk can be missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from tokenyard.api_errors import ApiError
from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.bus.senders import subscribe_heartbeats
from tokenyard.fleet import FleetView
from tokenyard.fleet.resume import resume_on_live_worker
from tokenyard.kv.hashing import (
    HASH_SPEC_VERSION,
    adapter_salt,
    prefix_block_hashes,
    salted_root,
)
from tokenyard.services.gateway.responses import ChunkOrderer
from tokenyard.services.gateway.senders import MAX_HELD_CHUNKS, RequestSenders
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

ROUTE_RETRY_DELAYS_S = (0.02, 0.05, 0.1, 0.2)
STREAM_CHECK_S = 1.0  # how often the gateway checks that the prefill stream it owns is there
STREAM_INFO_TIMEOUT_S = 2.0
RESUME_TIMEOUT_S = 5.0  # a decode worker answers a hand-off at once; this only bounds a stuck one

# resume(streamed tokens, the worker not to ask: the dead one, or "" when it came back
# restarted) -> the worker that took the request, or None
Resume = Callable[[list[int], str], Awaitable[str | None]]
# replay(from output index): ask the request's workers to send its chunks again
Replay = Callable[[int], Awaitable[None]]
# Ask for a replay when the stream has made no progress this long after a chunk went missing
# (a later one came first) or after the bus reconnected (chunks sent meanwhile are gone).
REPLAY_AFTER_S = 1.0


class TokenStream(Protocol):
    def __aiter__(self) -> TokenStream: ...

    async def __anext__(self) -> pb.TokenChunk: ...

    def has_chunk(self) -> bool:
        """True when the next __anext__ can answer without waiting for the workers."""
        ...

    async def close(self) -> None: ...

    @property
    def placement(self) -> pb.Placement:
        """The workers this request was placed on."""
        ...


class Backend(Protocol):
    fleet: FleetView

    def connected(self) -> bool: ...

    async def not_ready(self) -> str | None:
        """Why no request can be enqueued now (None: it can), asked now."""
        ...

    async def submit(
        self,
        rid: str,
        model: str,
        prompt_ids: list[int],
        params: pb.SamplingParams,
        placement: pb.Placement | None = None,
    ) -> TokenStream:
        """Route (unless `placement` is given: the same workers as an earlier request) and
        enqueue one sequence; its chunks come from the returned stream."""
        ...

    async def cancel(self, rid: str, reason: str) -> None: ...

    async def lora_call(
        self, worker_id: str, request: pb.LoRAAdapterRequest
    ) -> pb.LoRAAdapterReply | None:
        """Ask one worker to load or unload a LoRA adapter; None when it does not answer."""
        ...


def route_error(error: pb.RouteError, retry_after_s: int) -> ApiError:
    code = pb.RouteError.Code.Name(error.code).lower()
    retry = error.retry_after_s or retry_after_s
    if error.code == pb.RouteError.UNKNOWN_MODEL:
        return ApiError(
            404, error.message or "unknown model", param="model", code="model_not_found"
        )
    if error.code == pb.RouteError.CONTEXT_TOO_LONG:
        return ApiError(400, error.message, code="context_length_exceeded")
    message = error.message or "no worker can take this request now"
    return ApiError(503, message, code=code, retry_after_s=retry)


def chunk_error(error: pb.Error) -> ApiError:
    status = {pb.Error.INVALID_REQUEST: 400, pb.Error.OVERLOADED: 503, pb.Error.CANCELLED: 503}
    name = pb.Error.Code.Name(error.code).lower()
    return ApiError(status.get(error.code, 500), error.message or name, code=name)


class NatsTokenStream:
    """Ordered chunks of one request; fails clearly when its worker goes silent."""

    def __init__(
        self,
        subs: list[Subscription],
        queue: asyncio.Queue[pb.TokenChunk],
        placement: pb.Placement,
        fleet: FleetView,
        settings: GatewaySettings,
        resume: Resume | None = None,
        replay: Replay | None = None,
        reconnects: Callable[[], int] = lambda: 0,
        senders: RequestSenders | None = None,
    ) -> None:
        """`queue` holds the chunks `senders` admitted (their worker_id is their sender);
        `subs` (the tokens subscription first) end with the stream."""
        self._subs, self._queue, self._placement = subs, queue, placement
        self._senders = senders
        self._fleet, self._settings = fleet, settings
        self._resume = resume
        self._replay, self._reconnects = replay, reconnects
        self._orderer = ChunkOrderer()
        self._ready: deque[pb.TokenChunk] = deque()
        self._last_chunk = time.monotonic()
        timeout = settings.request_timeout_s
        self._deadline = self._last_chunk + timeout if timeout else None
        self._worker = placement.prefill_worker_id
        # The owner's incarnation (its heartbeat's kv_epoch, new at every start): a worker
        # restarted under the same id is alive, yet knows nothing of this request.
        self._incarnation = self._epoch(self._worker)
        self._told_waiting = False  # logged that no worker could resume it yet
        self._lost_at: float | None = None  # when its owner was first seen lost
        self._streamed: list[int] = []  # output tokens released in order so far
        # The last release in order, and the bus's reconnect count then.
        self._progress_at, self._progress_reconnects = self._last_chunk, reconnects()
        self._replayed_at = 0.0

    def __aiter__(self) -> NatsTokenStream:
        return self

    async def __anext__(self) -> pb.TokenChunk:
        poll = min(1.0, self._settings.dead_worker_grace_s)
        while not self._ready:
            if self._orderer.finished:
                raise StopAsyncIteration
            self._check_deadline(time.monotonic())
            await self._maybe_replay(time.monotonic())
            try:
                chunk = await asyncio.wait_for(self._queue.get(), timeout=poll)
            except TimeoutError:
                self._recheck_moves(time.monotonic())
                await self._check_stall(time.monotonic())
                continue
            if chunk.error.code:
                raise chunk_error(chunk.error)
            self._last_chunk = time.monotonic()
            self._set_owner(self._owner(chunk))
            released = self._orderer.push(chunk)
            if released:
                self._progress_at, self._progress_reconnects = self._last_chunk, self._reconnects()
            for c in released:
                self._streamed.extend(c.token_ids)
            self._ready.extend(released)
        return self._ready.popleft()

    def has_chunk(self) -> bool:
        return bool(self._ready) or not self._queue.empty()

    def _recheck_moves(self, now: float) -> None:
        """Chunks of a moved job, once this gateway's fleet view agrees with the move."""
        if self._senders is not None:
            for chunk in self._senders.recheck(now):
                self._queue.put_nowait(chunk)

    @property
    def placement(self) -> pb.Placement:
        return self._placement

    def _owner(self, chunk: pb.TokenChunk) -> str:
        """The worker that owes the next chunk: after the prefill worker's first token, the
        decode worker; once a chunk past the first arrives, whoever sent it (a prefill worker
        that decodes itself when no decode worker took the hand-off)."""
        if chunk.index == 0 and self._placement.decode_worker_id:
            return self._placement.decode_worker_id
        return chunk.worker_id or self._worker

    def _epoch(self, worker_id: str) -> str:
        view = self._fleet.get(worker_id)
        return view.heartbeat.kv_epoch if view is not None else ""

    def _set_owner(self, worker_id: str) -> None:
        self._worker, self._incarnation = worker_id, self._epoch(worker_id)
        self._told_waiting, self._lost_at = False, None

    def _owner_lost(self, now: float) -> bool:
        """The owner died, or came back restarted (a new incarnation under the same id)."""
        if self._fleet.is_dead(self._worker, now):
            return True
        epoch = self._epoch(self._worker)
        return bool(epoch and self._incarnation and epoch != self._incarnation)

    async def _maybe_replay(self, now: float) -> None:
        """Core NATS drops what is published while a subscriber's server restarts: when a
        chunk is missing, ask the workers to send the stream again from the first gap."""
        if self._replay is None or now - max(self._progress_at, self._replayed_at) < REPLAY_AFTER_S:
            return
        if not self._orderer.waiting() and self._reconnects() == self._progress_reconnects:
            return
        self._replayed_at = now
        await self._replay(self._orderer.next_index)

    def _check_deadline(self, now: float) -> None:
        if self._deadline is not None and now > self._deadline:
            raise ApiError(
                504,
                f"the request ran past the server's deadline of "
                f"{self._settings.request_timeout_s:.0f} s; ask for fewer tokens (max_tokens)",
                code="timeout",
            )

    async def _check_stall(self, now: float) -> None:
        silent = now - self._last_chunk
        if silent > self._settings.idle_timeout_s:
            raise ApiError(
                504, f"no tokens for {silent:.0f} s: the request timed out", code="timeout"
            )
        self._follow_move(now)
        if not self._owner_lost(now):
            self._lost_at = None
            return
        if not self._streamed and self._restarted(now):
            self._adopt_restarted(now)
            return
        if self._lost_at is None:
            self._lost_at = now
        if self._streamed and self._resume is not None and await self._resume_elsewhere(now):
            return
        # NOTE: the grace counts from the loss, not from the last chunk: a request that sat
        # in the queue longer than the grace before its worker died was refused at once.
        if now - max(self._lost_at, self._last_chunk) > self._grace():
            why = "no live worker could resume the request" if self._streamed else "it was lost"
            raise self._lost(why)

    def _follow_move(self, now: float) -> None:
        """The router moved the lost owner's job to a live worker (believed: `senders`): that
        worker owes the next chunk now, and the request waits its turn in that worker's
        queue as a newly queued one does (its silence counted from the move).

        NOTE: before, the owner stayed the departed worker, so the grace for a lost worker
        ran on while the moved job waited its turn; behind a long queue there (the load
        step of issue 44) the request was refused with worker_lost just before it ran."""
        target = self._senders.moved.get(self._worker) if self._senders is not None else None
        if target is None or target == self._worker:
            return
        log.info("%s: its job moved from %s to %s", self._subs[0].subject, self._worker, target)
        self._set_owner(target)
        self._last_chunk = now

    def _restarted(self, now: float) -> bool:
        """The owner is alive again under a new incarnation (restarted under the same id)."""
        return self._fleet.alive(self._worker, now) and self._owner_lost(now)

    def _adopt_restarted(self, now: float) -> None:
        """A request with no token yet whose worker restarted: its job waits in that worker's
        work-queue consumer, which delivers it again to the new incarnation, so the request
        waits for it as for a newly queued one (its silence counted from now).

        NOTE: before, the new incarnation made the owner "lost" for good (no chunk had come
        to adopt it), so the queued request was refused once the grace, counted from its
        submission, ran out, while the restarted worker was about to run it."""
        log.info(
            "worker %s restarted before %s's first token; waiting for its redelivered job",
            self._worker,
            self._subs[0].subject,
        )
        self._set_owner(self._worker)
        self._last_chunk = now

    def _grace(self) -> float:
        """How long a request whose owner died may wait for a worker to go on with it.

        Mid-decode a live worker resumes it at once; before the first token its job waits
        in the prefill work queue, which redelivers it. With no live worker to take it
        (one worker, or a whole role down) both wait for the launcher or the orchestrator
        to restart one, which loads its model first: a long wait, not an error."""
        return max(self._settings.dead_worker_grace_s, self._settings.prefill_redelivery_grace_s)

    async def _resume_elsewhere(self, now: float) -> bool:
        """Continue the request on a live worker from the tokens already streamed; False
        when none took it (asked again at the next poll, until the grace runs out).

        NOTE: the same request may also be running again already: a job not yet acked (its
        worker decoded it itself) is redelivered by the work queue. A worker that has it
        running joins this resume to it (HandoffAck accepted), so the two never race."""
        assert self._resume is not None
        lost = self._worker
        exclude = lost if self._fleet.is_dead(lost, now) else ""  # "": it came back, restarted
        taker = await self._resume(list(self._streamed), exclude)
        if taker is not None and self._senders is not None:
            for chunk in self._senders.allow(taker):  # what it sent before its answer came
                self._queue.put_nowait(chunk)
        if taker is None:
            if not self._told_waiting:
                self._told_waiting = True
                log.warning(
                    "worker %s lost %s and no live worker could resume it yet; waiting",
                    lost,
                    self._subs[0].subject,
                )
            return False
        log.warning(
            "worker %s lost %s; resumed it on %s after %d tokens",
            lost,
            self._subs[0].subject,
            taker,
            len(self._streamed),
        )
        self._set_owner(taker)
        self._last_chunk = time.monotonic()
        return True

    def _lost(self, why: str) -> ApiError:
        return ApiError(
            503,
            f"worker {self._worker} stopped sending heartbeats; {why}",
            code="worker_lost",
            retry_after_s=self._settings.retry_after_s,
        )

    async def close(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may already be closing; nothing left to free
                log.debug("unsubscribe failed", exc_info=True)


class NatsBackend:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.fleet = FleetView(settings.missed_heartbeats)
        self.bus: Bus | None = None
        self._stream_keeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        bus = await Bus.connect(
            self.settings.nats_url,
            name="gateway",
            first_connect_timeout=self.settings.connect_timeout_s,
        )
        self.bus = bus
        await self._make_stream(bus)
        await subscribe_heartbeats(bus, self._on_heartbeat)
        self._stream_keeper = asyncio.create_task(self._keep_stream(bus), name="prefill stream")

    async def stop(self) -> None:
        if self._stream_keeper is not None:
            self._stream_keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stream_keeper
        if self.bus:
            await self.bus.close()

    # --- the prefill stream: the gateway owns it (tokenyard.bus.auth) ---------------------

    async def _make_stream(self, bus: Bus) -> None:
        await bus.ensure_work_queue(
            subjects.PREFILL_STREAM,
            subjects.PREFILL_SUBJECTS,
            replicas=self.settings.jetstream_replicas,
        )

    async def _keep_stream(self, bus: Bus) -> None:
        """Make the prefill stream again once it is gone (deleted by hand, a NATS restart
        without its store): no worker may, and no job is enqueued without it."""
        while True:
            await asyncio.sleep(STREAM_CHECK_S)
            try:
                if await self._stream_missing(bus):
                    log.warning("the %s stream is gone; making it again", subjects.PREFILL_STREAM)
                    await self._make_stream(bus)
            except Exception as exc:  # JetStream not answering now: the next check retries
                log.debug("checking the %s stream failed: %s", subjects.PREFILL_STREAM, exc)

    async def _stream_missing(self, bus: Bus) -> bool:
        exists = bus.stream_exists(subjects.PREFILL_STREAM)
        return not await asyncio.wait_for(exists, STREAM_INFO_TIMEOUT_S)

    async def not_ready(self) -> str | None:
        if not self.connected():
            return "not connected to NATS"
        assert self.bus is not None
        try:
            missing = await self._stream_missing(self.bus)
        except Exception as exc:
            return f"JetStream does not answer ({type(exc).__name__})"
        if missing:
            return f"the prefill job stream {subjects.PREFILL_STREAM} is missing (being made again)"
        return None

    async def _on_heartbeat(self, hb: pb.WorkerHeartbeat, _: Msg) -> None:
        self.fleet.on_heartbeat(hb, time.monotonic())

    async def lora_call(
        self, worker_id: str, request: pb.LoRAAdapterRequest
    ) -> pb.LoRAAdapterReply | None:
        try:
            return await self._bus().request(
                subjects.lora(worker_id),
                request,
                pb.LoRAAdapterReply,
                timeout=self.settings.lora_timeout_s,
            )
        except (NatsTimeoutError, TimeoutError, NoRespondersError) as exc:
            log.warning("worker %s did not answer a LoRA %s: %s", worker_id, request.action, exc)
            return None

    def connected(self) -> bool:
        return self.bus is not None and self.bus.nc.is_connected

    def _bus(self) -> Bus:
        if not self.connected():
            raise ApiError(
                503,
                "the gateway is not connected to NATS",
                code="bus_unavailable",
                retry_after_s=self.settings.retry_after_s,
            )
        assert self.bus is not None
        return self.bus

    async def submit(
        self,
        rid: str,
        model: str,
        prompt_ids: list[int],
        params: pb.SamplingParams,
        placement: pb.Placement | None = None,
    ) -> NatsTokenStream:
        bus = self._bus()
        queue: asyncio.Queue[pb.TokenChunk] = asyncio.Queue()
        senders: RequestSenders | None = None
        early: list[tuple[str | None, pb.TokenChunk]] = []  # before the placement is known

        async def on_chunk(chunk: pb.TokenChunk, msg: Msg) -> None:
            sender = subjects.tokens_sender(msg.subject)
            if senders is None:  # a few at most: none is due before the job is queued
                if len(early) < MAX_HELD_CHUNKS:
                    early.append((sender, chunk))
                return
            for admitted in senders.admit(sender, chunk):
                queue.put_nowait(admitted)

        async def on_moved(moved: pb.JobMoved, _: Msg) -> None:
            if senders is not None:
                for admitted in senders.on_moved(moved, time.monotonic()):
                    queue.put_nowait(admitted)

        gateway_id = self.settings.instance_id
        subs = [
            await bus.subscribe(subjects.request_tokens(gateway_id, rid), pb.TokenChunk, on_chunk)
        ]
        try:
            subs.append(await bus.subscribe(subjects.moved(gateway_id, rid), pb.JobMoved, on_moved))
            if placement is None:
                placement = await self._route(bus, rid, model, prompt_ids, params)
            senders = RequestSenders(rid, placement, self.fleet)
            for sender, chunk in early:
                for admitted in senders.admit(sender, chunk):
                    queue.put_nowait(admitted)
            job = pb.PrefillJob(
                request_id=rid,
                model=model,
                prompt_token_ids=prompt_ids,
                params=params,
                decode_worker_id=placement.decode_worker_id,
                arrival_unix_ns=time.time_ns(),
                gateway_id=gateway_id,
            )
            await bus.js_publish(
                subjects.prefill_worker_jobs(placement.prefill_worker_id), job, msg_id=rid
            )
        except BaseException:
            for sub in subs:
                await sub.unsubscribe()
            raise
        resume = partial(self._resume, rid, model, prompt_ids, params)
        return NatsTokenStream(
            subs,
            queue,
            placement,
            self.fleet,
            self.settings,
            resume,
            replay=partial(self._replay, rid),
            reconnects=lambda: bus.nc.stats["reconnects"],
            senders=senders,
        )

    async def _replay(self, rid: str, from_index: int) -> None:
        if not self.connected():
            return  # asked again on the next poll
        assert self.bus is not None
        subject = subjects.replay(self.settings.instance_id, rid)
        try:
            await self.bus.publish(subject, pb.Replay(request_id=rid, from_index=from_index))
        except Exception:  # the connection may drop again; asked again on the next poll
            log.debug("replay request for %s failed", rid, exc_info=True)
        else:
            log.info("asked the workers of %s to send again from index %d", rid, from_index)

    async def _resume(
        self,
        rid: str,
        model: str,
        prompt_ids: list[int],
        params: pb.SamplingParams,
        streamed: list[int],
        exclude: str,
    ) -> str | None:
        """Hand a request whose decode worker died to a live worker (decode-capable first,
        prefill workers when none is left or each refuses), as a stopping decode worker
        hands over its own: the tokens so far travel as output tokens (so sampling positions
        and chunk indexes go on where they stopped) and, with no KV to pull, the new worker
        recomputes them. Returns the worker that took it, or None."""
        resume = pb.DecodeHandoff(
            request_id=rid,
            model=model,
            prompt_token_ids=prompt_ids,
            output_token_ids=streamed,
            params=params,
            arrival_unix_ns=time.time_ns(),
            gateway_id=self.settings.instance_id,
        )
        return await resume_on_live_worker(
            self._bus(),
            self.fleet.live(time.monotonic()),
            resume,
            exclude=exclude,
            timeout_s=RESUME_TIMEOUT_S,
        )

    async def _route(
        self,
        bus: Bus,
        rid: str,
        model: str,
        prompt_ids: list[int],
        params: pb.SamplingParams,
    ) -> pb.Placement:
        request = pb.RouteRequest(
            request_id=rid,
            model=model,
            num_prompt_tokens=len(prompt_ids),
            max_tokens=params.max_tokens,
            block_hashes=prefix_block_hashes(
                prompt_ids,
                self.settings.block_size,
                salted_root(adapter_salt(params.cache_salt, params.lora)),
            ),
            hash_version=HASH_SPEC_VERSION,
            priority=params.priority,
            lora=params.lora,
        )
        retry = self.settings.retry_after_s
        try:
            reply = await self._ask_router(bus, request)
        except NoRespondersError:
            raise ApiError(
                503,
                "no router is running: no workers can be reached",
                code="no_workers",
                retry_after_s=retry,
            ) from None
        except (NatsTimeoutError, TimeoutError):
            raise ApiError(
                503, "the router did not answer in time", code="router_timeout", retry_after_s=retry
            ) from None
        if reply.WhichOneof("result") != "placement":
            raise route_error(reply.error, retry)
        return reply.placement

    async def _ask_router(self, bus: Bus, request: pb.RouteRequest) -> pb.RouteReply:
        """One route request; "no responders" is asked again a few times, quickly.

        NOTE: a router that is restarting, or whose subscription is still on its way to the
        server, answers within milliseconds; a missing router still fails well under a second.
        """
        timeout = self.settings.route_timeout_s
        for delay in ROUTE_RETRY_DELAYS_S:
            try:
                return await bus.request(
                    subjects.ROUTER_ROUTE, request, pb.RouteReply, timeout=timeout
                )
            except NoRespondersError:
                await asyncio.sleep(delay)
        return await bus.request(subjects.ROUTER_ROUTE, request, pb.RouteReply, timeout=timeout)

    async def cancel(self, rid: str, reason: str) -> None:
        if self.connected():
            assert self.bus is not None
            subject = subjects.cancel(self.settings.instance_id, rid)
            await self.bus.publish(subject, pb.Cancel(request_id=rid, reason=reason))
