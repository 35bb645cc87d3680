"""One prefill-to-decode hand-off, both ends (the engine's half is tokenyard.engine.handoff).

    prefill worker: send(job)                     decode worker: take(handoff, reply)
      export the held sequence, offer its blocks    import it (fresh blocks), ack
      DecodeHandoff ---- ty.decode.<worker>.jobs --->
      <----------------------------- HandoffAck --
      refused or unanswered: decode_here()          pull the KV (or not: recompute), commit

A stopping decode worker hands what it still runs to another live worker
(:meth:`Handoffs.hand_over_running`), with the tokens streamed so far and no KV to pull.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from opentelemetry import trace

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.contract import Engine
from tokenyard.engine.outputs import RequestIdInUse
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.fleet import FleetView
from tokenyard.fleet.resume import resume_on_live_worker
from tokenyard.services.worker.convert import engine_params
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.kv import KVPort
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.services.worker.step_spans import record_steps
from tokenyard.services.worker.stream import TokenStream
from tokenyard.services.worker.streams import Streams
from tokenyard.tracing import GEN_AI_USAGE_OUTPUT_TOKENS, REQUEST_ID, WORKER_ID, tracer
from tokenyard.v1 import serving_pb2 as pb

_tracer = tracer("tokenyard.worker")
log = logging.getLogger(__name__)

HAND_OVER_TIMEOUT_S = 2.0  # a live decode worker answers a hand-off at once
# A HandoffAck's message when the request already runs (or is held) on the taker: it is
# accepted, and no KV is pulled for it.
JOINED = "already running here"

Reply = Callable[[pb.HandoffAck], Awaitable[None]]


# How long a hand-off's KV endpoint may take to appear in this worker's fleet view (two
# heartbeats) before the prompt is recomputed instead of pulled.
ENDPOINT_WAIT_S = 2.0


class Handoffs:
    def __init__(
        self,
        settings: WorkerSettings,
        bus: Bus,
        engine: Engine,
        params_cls: type[SamplingParams],
        loop: EngineLoop,
        streams: Streams,
        kv: KVPort,
        fleet: FleetView,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.bus = bus
        self.engine = engine
        self.params_cls = params_cls
        self.loop = loop
        self.streams = streams
        self.kv = kv
        self.fleet = fleet
        self.running: dict[str, pb.DecodeHandoff] = {}  # taken here, still decoding

    # --- the prefill side ----------------------------------------------------------------

    async def send(self, job: pb.PrefillJob, cached_tokens: int) -> TokenStream | None:
        """Hand a prefilled job to its decode worker; decode it here when that one does not
        take it (its finished stream is returned then, else None)."""
        rid = job.request_id
        exported = await self.loop.call(self.engine.export_sequence, rid)
        if self.streams.is_cancelled(rid):
            await self.kv.end_hold(rid, "cancelled")
            return None
        endpoint, src_block_ids = await self.kv.offer(rid, list(exported.block_ids))
        handoff = pb.DecodeHandoff(
            request_id=rid,
            model=job.model,
            prompt_token_ids=exported.prompt_token_ids,
            output_token_ids=exported.output_token_ids,
            params=job.params,
            prefill_worker_id=self.worker_id,
            kv_endpoint=endpoint,
            src_block_ids=src_block_ids,
            num_cached_tokens=cached_tokens,
            arrival_unix_ns=job.arrival_unix_ns,
            gateway_id=job.gateway_id,
        )
        with _tracer.start_as_current_span(
            "handoff",
            attributes={REQUEST_ID: rid, "tokenyard.decode_worker": job.decode_worker_id},
        ) as span:
            ack = await self._offer(job.decode_worker_id, handoff)
            accepted = ack is not None and ack.accepted
            span.set_attribute("tokenyard.accepted", accepted)
        if not endpoint or not accepted or (ack is not None and ack.message == JOINED):
            await self.kv.end_hold(rid, "not pulled")
        if accepted or self.streams.is_cancelled(rid):
            return None
        log.warning("decode worker %s did not take %s; decoding it here", job.decode_worker_id, rid)
        return await self.decode_here(handoff)

    async def _offer(
        self, decode_worker_id: str, handoff: pb.DecodeHandoff
    ) -> pb.HandoffAck | None:
        """The decode worker's answer (None: none came)."""
        try:
            ack = await self.bus.request(
                subjects.decode_jobs(decode_worker_id),
                handoff,
                pb.HandoffAck,
                timeout=self.settings.handoff_timeout_s,
            )
        except Exception as exc:  # no responders, timeout, connection trouble: decode here
            log.info(
                "hand-off of %s to %s failed: %s",
                handoff.request_id,
                decode_worker_id,
                type(exc).__name__,
            )
            return None
        if not ack.accepted:
            log.info(
                "decode worker %s refused %s: %s", decode_worker_id, handoff.request_id, ack.message
            )
        return ack

    async def decode_here(self, handoff: pb.DecodeHandoff) -> TokenStream:
        """Continue a handed-off sequence on this worker by recomputing its prompt."""
        # Our own prefill may still hold the sequence: the KV server frees a refused
        # hand-off's hold in a task of its own, which can run after this import, and the
        # engine then says "request id ... is already in use". release() frees only a held
        # (prefilled, unpulled) sequence, so a late second release is harmless.
        await self.loop.call(self.engine.release, handoff.request_id)
        stream, dst = await self.import_handoff(handoff)
        if dst is not None:  # else a resume of it runs here already: wait for that one
            await self.commit(handoff.request_id, kv_ok=False)
        await stream.done
        return stream

    # --- the decode side -----------------------------------------------------------------

    async def take(self, handoff: pb.DecodeHandoff, reply: Reply) -> TokenStream | None:
        """Import a hand-off, answer it, pull its KV and start decoding it; returns its
        stream (None: not taken, or it joined a start of the request already running)."""
        rid = handoff.request_id
        try:
            stream, dst = await self.import_handoff(handoff)
        except RequestIdInUse:
            # Held here for a hand-off of our own (prefilled, not yet taken): that hand-off
            # goes on with it, to its decode worker or here, so this start joins it.
            await reply(pb.HandoffAck(request_id=rid, accepted=True, message=JOINED))
            return None
        except Exception as exc:  # NoFreeBlocks, a bad sequence: the prefill worker keeps it
            await reply(pb.HandoffAck(request_id=rid, accepted=False, message=str(exc)))
            return None
        if dst is None:
            await reply(pb.HandoffAck(request_id=rid, accepted=True, message=JOINED))
            return None
        self.running[rid] = handoff
        stream.done.add_done_callback(lambda _: self.running.pop(rid, None))
        await reply(pb.HandoffAck(request_id=rid, accepted=True))
        attributes = {REQUEST_ID: rid, WORKER_ID: self.worker_id}
        with _tracer.start_as_current_span("kv_transfer", attributes=attributes) as span:
            endpoint = await self.fleet_kv_endpoint(handoff)
            kv_ok = await self.kv.pull(endpoint, rid, list(handoff.src_block_ids), dst)
            span.set_attributes({"kv.blocks": len(dst), "tokenyard.kv_ok": kv_ok})
        if stream.done.done():  # cancelled while we pulled
            return stream
        started_ns = time.time_ns()
        decode = _tracer.start_span("decode", start_time=started_ns, attributes=attributes)
        stream.done.add_done_callback(
            lambda done: _end_decode_span(decode, started_ns, stream, done)
        )
        with trace.use_span(decode):
            await self.commit(rid, kv_ok=kv_ok)
        return stream

    async def fleet_kv_endpoint(self, handoff: pb.DecodeHandoff) -> str:
        """The hand-off's KV endpoint if a live worker advertises it in its heartbeats, else
        "" (the prompt is recomputed). A worker that started a moment ago may not have heard
        the prefill worker's heartbeat yet: it waits up to ENDPOINT_WAIT_S for one.

        NOTE: a hand-off is a NATS message that any service allowed to publish decode jobs
        (the gateway, to resume) can forge; a pull presents this worker's gRPC token, so it
        goes only to an endpoint the fleet's own heartbeats vouch for, never to whatever
        address a hand-off names."""
        endpoint = handoff.kv_endpoint
        if not endpoint:
            return ""
        deadline = time.monotonic() + ENDPOINT_WAIT_S
        while True:
            advertised = {w.heartbeat.kv_endpoint for w in self.fleet.live(time.monotonic())}
            if endpoint in advertised:
                return endpoint
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.1)
        log.warning(
            "hand-off %s names KV endpoint %r, which no live worker advertises; recomputing "
            "the prompt instead of pulling",
            handoff.request_id,
            endpoint[:200],
        )
        return ""

    async def import_handoff(
        self, handoff: pb.DecodeHandoff
    ) -> tuple[TokenStream, list[int] | None]:
        """Allocate blocks for a handed-off sequence (raises when the pool is full, and
        RequestIdInUse when the engine holds it with no stream running here).

        One request runs at most once here: a hand-off, a gateway's resume and a redelivered
        job can all start the same request, in any order. When it already runs here this
        one joins it: the running stream is returned with no blocks (None)."""
        rid = handoff.request_id
        running = self.streams.running.get(rid)
        if running is not None:
            log.info("%s already runs here; this start of it joins it", rid)
            return running, None
        # The stream is registered before the engine call so that a start arriving while
        # the import runs finds it (and joins) instead of importing the request twice.
        stream = self.streams.open(
            rid,
            handoff.gateway_id,
            start_index=len(handoff.output_token_ids),
            cached_tokens=handoff.num_cached_tokens,
            arrival_unix_ns=handoff.arrival_unix_ns,
        )
        params = engine_params(handoff.params, self.params_cls)
        try:
            dst = await self.loop.call(
                self.engine.import_sequence,
                rid,
                list(handoff.prompt_token_ids),
                list(handoff.output_token_ids),
                params,
            )
        except BaseException:
            self.streams.discard(stream)
            raise
        stream.output_token_ids.extend(handoff.output_token_ids)
        self.loop.sinks[rid] = stream
        return stream, list(dst)

    async def commit(self, request_id: str, *, kv_ok: bool) -> None:
        """Start decoding an imported sequence (kv_ok=False: the engine recomputes the prompt)."""
        stream = self.streams.running.get(request_id)
        if stream is not None and self.streams.is_cancelled(request_id):
            # The cancel came while the hand-off was imported, before its stream existed to
            # be aborted (on_cancel found nothing to stop): stop it now, freeing the blocks.
            await self.streams.abort(stream)
            return
        if stream is not None and not await self.streams.admit(stream):
            return  # cancelled or handed back while it waited; its abort freed the blocks
        await self.loop.call(self.engine.commit_import, request_id, kv_ok)
        self.loop.wake()

    # --- a stopping decode worker ----------------------------------------------------------

    async def hand_over_running(self) -> None:
        """Move every sequence still running here to another live worker."""
        for rid, handoff in list(self.running.items()):
            stream = self.streams.running.get(rid)
            if stream is None:
                continue
            await self.loop.abort(rid)
            resume = pb.DecodeHandoff()
            resume.CopyFrom(handoff)
            resume.ClearField("output_token_ids")
            resume.output_token_ids.extend(stream.output_token_ids)
            resume.kv_endpoint = ""
            resume.ClearField("src_block_ids")
            taker = await resume_on_live_worker(
                self.bus,
                self.fleet.live(time.monotonic()),
                resume,
                exclude=self.worker_id,
                timeout_s=HAND_OVER_TIMEOUT_S,
            )
            if taker is not None:
                await stream.handed_to(taker)
            else:
                await stream.fail(
                    pb.Error.INTERNAL,
                    "the decode worker stopped and no other could take the request",
                )


def _end_decode_span(
    span: trace.Span, started_ns: int, stream: TokenStream, done: asyncio.Future[str]
) -> None:
    with trace.use_span(span, end_on_exit=False):
        record_steps(_tracer, started_ns, stream.output_times, prefill_tokens=None)
    span.set_attribute(GEN_AI_USAGE_OUTPUT_TOKENS, len(stream.output_token_ids))
    span.set_attribute("tokenyard.finish_reason", done.result() if not done.cancelled() else "")
    span.end()
