"""The shared worker: engine thread, heartbeats, cancel, KV events, generation helpers.

Role handlers (prefill.py, decode.py) sit on top of one WorkerBase; a worker with role
"both" runs both handlers over the same engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from nats.aio.msg import Msg

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.contract import Engine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.facilities.tracker import RackStateTracker
from tokenyard.fleet import FleetView
from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.services.worker.admission import AdmissionGate
from tokenyard.services.worker.convert import engine_params
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.kv import KVPort
from tokenyard.services.worker.metrics import WorkerMetrics, since_arrival_s
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.services.worker.stream import TokenStream
from tokenyard.tracing import (
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
    REQUEST_ID,
    WORKER_ID,
    tracer,
)
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import RackState

_tracer = tracer("tokenyard.worker")
log = logging.getLogger(__name__)

CANCELLED_TTL_S = 300.0  # remember cancelled ids this long (their job may still be queued)
# Keep an ended stream's chunks this long for a gateway that missed some (Replay).
REPLAY_TTL_S = 60.0
STEP_LOG_S = 10.0  # how often a busy worker logs its step timings
# A KV dump's bytes besides its hashes (ids, epoch, headers): what it leaves of max_payload.
DUMP_OVERHEAD_BYTES = 4096


class WorkerBase:
    def __init__(
        self,
        settings: WorkerSettings,
        bus: Bus,
        engine: Engine,
        params_cls: type[SamplingParams],
        *,
        engine_thread: ThreadPoolExecutor | None = None,
    ) -> None:
        """``engine_thread``: the thread ``engine`` was built on (engine_loop.engine_thread)."""
        self.settings = settings
        self.worker_id = settings.worker_id
        self.bus = bus
        self.engine = engine
        self.params_cls = params_cls
        self.loop = EngineLoop(engine, on_kv_events=self._publish_kv_events, thread=engine_thread)
        self.kv = KVPort(self.loop, settings)
        self.streams: dict[str, TokenStream] = {}
        self.ended: dict[str, tuple[float, TokenStream]] = {}  # for replays, REPLAY_TTL_S
        self.cancelled: dict[str, float] = {}
        self.fleet = FleetView()  # every worker's heartbeats, ours included
        # The facilities service's word on our rack; it caps how many sequences we admit.
        self.facilities = RackStateTracker()
        self.gate = AdmissionGate(self.seq_cap)
        # request id -> outcome of the job running here (True done, False handed back,
        # None failed): a redelivered copy of it waits for that instead of running twice.
        self.jobs: dict[str, asyncio.Future[bool | None]] = {}
        self.stopping = asyncio.Event()
        # KV events are numbered 1, 2, ... within this process's epoch (the router's
        # tokenyard.services.router.kv_sync): a gap or a new epoch makes it ask for a dump.
        self.kv_epoch = secrets.token_hex(8)
        # Cleared while an operator has drained this worker (control.py): no new work.
        self.accepting = asyncio.Event()
        self.accepting.set()
        self.drain_reason = ""
        self.control_endpoint = ""  # the WorkerControl server, once started
        self._kv_seq = 0
        self.metrics = WorkerMetrics(self.worker_id, settings.role, self.model_id)
        self._loop_task: asyncio.Task[None]
        self._tokens_at = (time.monotonic(), 0)
        self._step_log_at = time.monotonic()
        # More reasons the worker may not take work (its work queue's consumer), registered
        # by the role handlers.
        self.readiness_checks: list[Callable[[], str | None]] = []

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    def decode_text(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids)

    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.kv.start()
        self._loop_task = tg.create_task(self.loop.run(), name="engine-loop")
        await self.bus.subscribe(subjects.CANCEL_ALL, pb.Cancel, self.on_cancel)
        await self.bus.subscribe(subjects.REPLAY_ALL, pb.Replay, self.on_replay)
        await self.bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, self.on_rack_state)
        await self.bus.subscribe(
            subjects.HEARTBEATS_ALL, pb.WorkerHeartbeat, self.on_peer_heartbeat
        )
        await self.bus.subscribe(
            subjects.kv_resync(self.worker_id), pb.KVResyncRequest, self.on_kv_resync
        )
        await self._publish_kv_events([("cleared", [])])  # event 1: a new process holds nothing
        tg.create_task(self._heartbeats(), name="heartbeats")

    async def wait_idle(self, timeout: float) -> bool:
        """Wait for in-flight requests to finish; False if some are still running."""
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.streams

    async def hand_back_all(self) -> None:
        """Stop every request still running here without ending it for the client."""
        for rid, stream in list(self.streams.items()):
            await self.loop.abort(rid)
            stream.hand_back()

    async def stop(self) -> None:
        self._loop_task.cancel()
        await self.kv.stop()
        self.loop.shutdown()

    # --- running requests --------------------------------------------------------------

    def new_stream(
        self,
        request_id: str,
        gateway_id: str,
        *,
        start_index: int = 0,
        cached_tokens: int | None = None,
        arrival_unix_ns: int = 0,
    ) -> TokenStream:
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
        self.streams[request_id] = stream
        stream.done.add_done_callback(lambda _: self._ended(stream))
        return stream

    def _ended(self, stream: TokenStream) -> None:
        request_id = stream.request_id
        if self.streams.get(request_id) is stream:  # not a newer stream of the same request
            del self.streams[request_id]
        now = time.monotonic()
        self.ended.pop(request_id, None)  # to the end of the insertion order
        self.ended[request_id] = (now, stream)
        while self.ended:  # oldest first: dicts keep insertion order
            rid, (at, _) = next(iter(self.ended.items()))
            if now - at <= REPLAY_TTL_S:
                break
            del self.ended[rid]

    async def generate(
        self,
        request_id: str,
        gateway_id: str,
        prompt: list[int],
        params: pb.SamplingParams,
        *,
        prefill_only: bool = False,
        arrival_unix_ns: int = 0,
        on_prompt_computed: Callable[[], None] | None = None,
    ) -> TokenStream:
        """Run a request (or just its prefill) here; returns its stream once it has ended.

        ``on_prompt_computed`` is called once, with the request's first output."""
        stream = self.new_stream(request_id, gateway_id, arrival_unix_ns=arrival_unix_ns)
        stream.on_prompt_computed = on_prompt_computed
        attributes = {REQUEST_ID: request_id, WORKER_ID: self.worker_id}
        # The queue span starts at the request's arrival: the work queue plus admission here.
        with _tracer.start_as_current_span(
            "queue", start_time=arrival_unix_ns or None, attributes=attributes
        ):
            admitted = await self._admit(stream)
        if not admitted:
            return stream  # cancelled or handed back while it waited
        if self.is_cancelled(request_id):  # cancelled before its stream existed (a fetch)
            await stream.aborted()
            return stream
        self.metrics.on_prompt(len(prompt), since_arrival_s(arrival_unix_ns))
        with _tracer.start_as_current_span(
            "prefill" if prefill_only else "generate", attributes=attributes
        ) as span:
            try:
                await self.loop.add(
                    request_id,
                    prompt,
                    engine_params(params, self.params_cls),
                    stream,
                    prefill_only=prefill_only,
                )
            except ValueError as exc:
                await stream.fail(pb.Error.INVALID_REQUEST, str(exc))
            reason = await stream.done
            span.set_attributes(stream_attributes(stream, len(prompt), reason))
        return stream

    async def commit(self, request_id: str, *, kv_ok: bool) -> None:
        """Start decoding an imported sequence (kv_ok=False: the engine recomputes the prompt)."""
        stream = self.streams.get(request_id)
        if stream is not None and self.is_cancelled(request_id):
            # The cancel came while the hand-off was imported, before its stream existed to
            # be aborted (on_cancel found nothing to stop): stop it now, freeing the blocks.
            await self._abort(stream)
            return
        if stream is not None and not await self._admit(stream):
            return  # cancelled or handed back while it waited; its abort freed the blocks
        await self.loop.call(self.engine.commit_import, request_id, kv_ok)
        self.loop.wake()

    async def decode_here(self, handoff: pb.DecodeHandoff) -> TokenStream:
        """Continue a handed-off sequence on this worker by recomputing its prompt."""
        # Our own prefill may still hold the sequence: the KV server frees a refused
        # hand-off's hold in a task of its own, which can run after this import, and the
        # engine then says "request id ... is already in use". release() frees only a held
        # (prefilled, unpulled) sequence, so a late second release is harmless.
        await self.loop.call(self.engine.release, handoff.request_id)
        stream, _ = await self.import_handoff(handoff)
        await self.commit(handoff.request_id, kv_ok=False)
        await stream.done
        return stream

    async def import_handoff(self, handoff: pb.DecodeHandoff) -> tuple[TokenStream, list[int]]:
        """Allocate blocks for a handed-off sequence (raises when the pool is full)."""
        rid = handoff.request_id
        params = engine_params(handoff.params, self.params_cls)
        dst = await self.loop.call(
            self.engine.import_sequence,
            rid,
            list(handoff.prompt_token_ids),
            list(handoff.output_token_ids),
            params,
        )
        stream = self.new_stream(
            rid,
            handoff.gateway_id,
            start_index=len(handoff.output_token_ids),
            cached_tokens=handoff.num_cached_tokens,
            arrival_unix_ns=handoff.arrival_unix_ns,
        )
        stream.output_token_ids.extend(handoff.output_token_ids)
        self.loop.sinks[rid] = stream
        return stream, list(dst)

    # --- admission: the facilities cap and redelivered jobs -----------------------------

    def seq_cap(self) -> int:
        """How many sequences may run here at once now; 0 = no cap beyond max_num_seqs."""
        throttle = self.facilities.state_for_worker(self.worker_id)
        if throttle.state == "drain":
            # The router sends nothing new; what it already sent must still end, one by one.
            return 1
        if throttle.state == "derate":
            return min(throttle.seq_cap or self.settings.max_num_seqs, self.settings.max_num_seqs)
        return 0

    async def on_rack_state(self, msg: RackState, _raw: Msg | None) -> None:
        self.facilities.apply(msg)
        self.gate.wake()

    async def _admit(self, stream: TokenStream) -> bool:
        """Wait for room under the cap; the place is held until the stream ends."""
        await self.gate.acquire()
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

    # --- cancel ------------------------------------------------------------------------

    async def on_cancel(self, cancel: pb.Cancel, _msg: Msg) -> None:
        rid = cancel.request_id
        now = time.monotonic()
        self.cancelled[rid] = now
        for old in [r for r, t in self.cancelled.items() if now - t > CANCELLED_TTL_S]:
            del self.cancelled[old]
        stream = self.streams.get(rid)
        if stream is None:
            return
        await self._abort(stream)
        log.info("cancelled %s (%s)", rid, cancel.reason or "no reason")

    async def _abort(self, stream: TokenStream) -> None:
        """Stop a cancelled request in the engine and end its stream for the client."""
        await self.loop.abort(stream.request_id)
        await stream.aborted()

    async def on_replay(self, replay: pb.Replay, _msg: Msg) -> None:
        rid = replay.request_id
        # Both, when this worker ran the request twice (its prefill, then its decode).
        streams = [self.streams.get(rid)]
        if rid in self.ended:
            streams.append(self.ended[rid][1])
        sent = 0
        for stream in streams:
            if stream is not None:
                sent += await stream.replay(replay.from_index)
        if sent:
            log.info("replayed %d chunks of %s from index %d", sent, rid, replay.from_index)

    def is_cancelled(self, request_id: str) -> bool:
        return request_id in self.cancelled

    # --- readiness, heartbeats and KV events --------------------------------------------

    def not_ready(self) -> str | None:
        """Why this worker cannot take work now (None: it can), from what it knows without
        asking anyone: its NATS connection, its engine, its handlers' last checks."""
        if not self.bus.nc.is_connected:
            return "not connected to NATS"
        stuck = self.loop.busy_for(time.monotonic())
        if stuck > self.settings.engine_stall_s:
            return f"the engine has not answered for {stuck:.0f} s"
        for check in self.readiness_checks:
            reason = check()
            if reason is not None:
                return reason
        return None

    async def on_peer_heartbeat(self, hb: pb.WorkerHeartbeat, _msg: Msg) -> None:
        self.fleet.on_heartbeat(hb, time.monotonic())

    def peer_alive(self, worker_id: str) -> bool:
        return self.fleet.alive(worker_id, time.monotonic())

    async def heartbeat(self) -> pb.WorkerHeartbeat:
        stats = await self.loop.stats()
        self.metrics.on_stats(stats)
        now, generated = time.monotonic(), self.loop.tokens_generated
        then, before = self._tokens_at
        self._tokens_at = (now, generated)
        fixed_s, per_token_s = self.loop.timing.fit()
        return pb.WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.settings.role,
            model=self.model_id,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_free_blocks=stats.num_free_blocks,
            num_blocks=stats.num_blocks,
            max_num_seqs=self.settings.max_num_seqs,
            seq_cap=self.seq_cap(),
            tokens_per_s=(generated - before) / (now - then) if now > then else 0.0,
            kv_endpoint=self.kv.endpoint,
            host=self.settings.advertised_host,
            sent_unix_ms=int(time.time() * 1000),
            block_size=self.engine.block_size,
            heartbeat_interval_ms=int(self.settings.heartbeat_interval_s * 1000),
            max_model_len=self.engine.max_model_len,
            step_fixed_ms=fixed_s * 1e3,
            step_ms_per_token=per_token_s * 1e3,
            pending_prompt_tokens=stats.num_pending_prompt_tokens,
            local_prefill=self.settings.takes_prefill_jobs and not self.settings.prefills,
            kv_epoch=self.kv_epoch,
            kv_seq=self._kv_seq,
            not_ready=self.not_ready() or "",
            draining=not self.accepting.is_set(),
            control_endpoint=self.control_endpoint,
        )

    def log_step_timings(self) -> None:
        """Every STEP_LOG_S, what the engine loop did (profiles of a loaded stack read it)."""
        now = time.monotonic()
        if now - self._step_log_at < STEP_LOG_S:
            return
        window = self.loop.timing.take_window()
        if window.steps:
            fixed_s, per_token_s = self.loop.timing.fit()
            log.info(
                "steps: %s; fit %.1f ms + %.2f ms/token",
                window.describe(now - self._step_log_at),
                fixed_s * 1e3,
                per_token_s * 1e3,
            )
        self._step_log_at = now

    async def _heartbeats(self) -> None:
        subject = subjects.heartbeat(self.settings.role, self.worker_id)
        while not self.stopping.is_set():
            try:
                await self.bus.publish(subject, await self.heartbeat())
                self.log_step_timings()
            except Exception:
                log.exception("heartbeat failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.settings.heartbeat_interval_s)

    async def _publish_kv_events(self, events: list[tuple[str, list[int]]]) -> None:
        kinds = {
            "stored": pb.KVEvent.STORED,
            "removed": pb.KVEvent.REMOVED,
            "cleared": pb.KVEvent.CLEARED,
        }
        for kind, hashes in events:
            self._kv_seq += 1
            event = pb.KVEvent(
                worker_id=self.worker_id,
                kind=kinds.get(kind, pb.KVEvent.KIND_UNSPECIFIED),
                block_hashes=hashes,
                hash_version=HASH_SPEC_VERSION,
                seq=self._kv_seq,
                epoch=self.kv_epoch,
            )
            await self.bus.publish(subjects.kv_events(self.worker_id), event)

    async def on_kv_resync(self, req: pb.KVResyncRequest, msg: Msg) -> None:
        """A router lost the thread of our KV events: answer with every block we hold."""
        # NOTE: the seq is read before the engine call. Every event up to it was drained
        # before the dump is taken, so the dump includes it; later events may or may not be
        # in the dump, and the router applies them on top, which ends in the same state.
        seq = self._kv_seq
        hashes = await self.loop.call(self.engine.cached_block_hashes)
        fits = max(0, (self.bus.nc.max_payload - DUMP_OVERHEAD_BYTES) // 8)  # fixed64 each
        dump = pb.KVDump(
            worker_id=self.worker_id,
            epoch=self.kv_epoch,
            seq=seq,
            block_hashes=hashes[-fits:] if fits else [],
            hash_version=HASH_SPEC_VERSION,
            truncated=len(hashes) > fits,
        )
        log.info(
            "KV resync for a router (%s): %d of %d blocks",
            req.reason or "no reason",
            len(dump.block_hashes),
            len(hashes),
        )
        await self.bus.reply(msg, dump)


def stream_attributes(stream: TokenStream, prompt_tokens: int, reason: str) -> dict[str, int | str]:
    return {
        GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens,
        GEN_AI_USAGE_OUTPUT_TOKENS: len(stream.output_token_ids),
        "tokenyard.cached_tokens": stream.cached_tokens or 0,
        "tokenyard.finish_reason": reason,
    }
