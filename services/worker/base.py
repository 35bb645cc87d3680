"""The shared worker: the engine loop and the collaborators every role handler talks to.

    worker.streams    requests running here: streams, cancel, replay, admission, redelivery
    worker.presence   heartbeats and readiness, peers' heartbeats, KV events and resync
    worker.handoffs   the prefill-to-decode hand-off, both ends
    worker.kv         the KV transfer endpoint (tokenyard.kv.transfer)
    worker.kvcache    the shared KV-cache service: prefix fetches, prompt and reply offloads

Role handlers (prefill.py, decode.py) sit on top of one WorkerBase; a worker with role
"both" runs both handlers over the same engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from nats.aio.msg import Msg

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.contract import Engine
from tokenyard.engine.outputs import RequestIdInUse
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.facilities.energy import EnergyLedger, PowerModel, open_counter
from tokenyard.services.worker.admission import AdmissionGate, RackCap
from tokenyard.services.worker.convert import engine_params
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.handoff import Handoffs
from tokenyard.services.worker.kv import KVPort
from tokenyard.services.worker.kvcache import KVCachePort
from tokenyard.services.worker.metrics import WorkerMetrics, since_arrival_s
from tokenyard.services.worker.presence import Presence
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.services.worker.step_spans import record_steps
from tokenyard.services.worker.stream import TokenStream
from tokenyard.services.worker.streams import Streams
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
        self.metrics = WorkerMetrics(self.worker_id, settings.role, engine.model_id)
        self.stopping = asyncio.Event()
        # Cleared while an operator has drained this worker (control.py): no new work.
        self.accepting = asyncio.Event()
        self.accepting.set()
        self.drain_reason = ""
        # The facilities service's word on our rack; it caps how many sequences we admit.
        self.cap = RackCap(settings)
        # KV events go out through the presence, made below (it needs the loop).
        self.loop = EngineLoop(
            engine,
            on_kv_events=lambda events: self.presence.publish_kv_events(events),
            thread=engine_thread,
            energy=energy_ledger(settings),
        )
        self.kv = KVPort(self.loop, settings)
        self.kvcache = KVCachePort(self.loop, settings, self.metrics)
        gate = AdmissionGate(self.cap.seq_cap, settings.scheduling_policy)
        self.streams = Streams(bus, self.worker_id, self.loop, gate, self.metrics, self.decode_text)
        self.presence = Presence(
            settings,
            bus,
            engine,
            self.loop,
            self.kv,
            self.metrics,
            seq_cap=self.cap.seq_cap,
            accepting=self.accepting,
        )
        self.handoffs = Handoffs(
            settings,
            bus,
            engine,
            params_cls,
            self.loop,
            self.streams,
            self.kv,
            self.presence.fleet,
        )
        self._loop_task: asyncio.Task[None]

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    def decode_text(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids)

    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.kv.start()
        await self.kvcache.start()
        self._loop_task = tg.create_task(self.loop.run(), name="engine-loop")
        await self.bus.subscribe(subjects.CANCEL_ALL, pb.Cancel, self.streams.on_cancel)
        await self.bus.subscribe(subjects.REPLAY_ALL, pb.Replay, self.streams.on_replay)
        await self.bus.subscribe(subjects.FACILITIES_STATE_ALL, RackState, self.on_rack_state)
        await self.presence.start(tg, self.stopping)

    async def stop(self) -> None:
        await self.kvcache.stop()  # its uploads first: their copy-outs need the engine loop
        self._loop_task.cancel()
        await self.kv.stop()
        self.loop.shutdown()

    async def on_rack_state(self, msg: RackState, _raw: Msg | None) -> None:
        self.cap.apply(msg)
        self.streams.gate.wake()

    # --- running requests --------------------------------------------------------------

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
        before_add: Callable[[], Awaitable[object]] | None = None,
    ) -> TokenStream:
        """Run a request (or just its prefill) here; returns its stream once it has ended.

        ``on_prompt_computed`` is called once, with the request's first output;
        ``before_add()`` (a KV-cache fetch under way) is awaited once the request is admitted,
        before the engine sees it, so the two waits overlap. A request
        that already runs here (a gateway's resume of it came first) is joined, not started
        again: its stream is returned once it has ended."""
        running = self.streams.running.get(request_id)
        if running is not None:
            log.info("%s already runs here; its job waits for it", request_id)
            await running.done
            return running
        stream = self.streams.open(request_id, gateway_id, arrival_unix_ns=arrival_unix_ns)
        stream.from_job = True  # a prefill job's (PrefillHandler.run_job, the one caller)
        stream.on_prompt_computed = on_prompt_computed
        attributes = {REQUEST_ID: request_id, WORKER_ID: self.worker_id}
        # The queue span starts at the request's arrival: the work queue plus admission here.
        with _tracer.start_as_current_span(
            "queue", start_time=arrival_unix_ns or None, attributes=attributes
        ):
            admitted = await self.streams.admit(stream, params, len(prompt) + params.max_tokens)
        if not admitted:
            return stream  # cancelled or handed back while it waited
        if before_add is not None:
            await before_add()
        if self.stopping.is_set():  # stopped while it waited: it goes on elsewhere, unbegun
            stream.hand_back()
            return stream
        if self.streams.is_cancelled(request_id):  # cancelled before its stream existed (a fetch)
            await stream.aborted()
            return stream
        self.metrics.on_prompt(len(prompt), since_arrival_s(arrival_unix_ns))
        started_ns = time.time_ns()
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
            except RequestIdInUse as exc:  # our fault, not the client's: a server error
                await stream.fail(pb.Error.INTERNAL, str(exc))
            except ValueError as exc:
                await stream.fail(pb.Error.INVALID_REQUEST, str(exc))
            reason = await stream.done
            span.set_attributes(stream_attributes(stream, len(prompt), reason))
            computed = len(prompt) - (stream.cached_tokens or 0)
            record_steps(_tracer, started_ns, stream.output_times, prefill_tokens=computed)
        return stream


def energy_ledger(settings: WorkerSettings) -> EnergyLedger:
    """Energy per request for this worker's device: modelled, and measured where it can be."""
    model = PowerModel.for_device(
        settings.device, settings.tensor_parallel_size, settings.max_num_seqs, settings.energy_tdp_w
    )
    return EnergyLedger(model, open_counter(settings.energy_counter, settings.device))


def stream_attributes(stream: TokenStream, prompt_tokens: int, reason: str) -> dict[str, int | str]:
    return {
        GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens,
        GEN_AI_USAGE_OUTPUT_TOKENS: len(stream.output_token_ids),
        "tokenyard.cached_tokens": stream.cached_tokens or 0,
        "tokenyard.finish_reason": reason,
    }
