"""Decode role: take handed-off sequences, pull their KV, decode them with continuous batching.

Hand-offs arrive by core NATS request/reply on ``ty.decode.<worker>.jobs``; the reply
(HandoffAck) tells the prefill worker whether we took the sequence. A stopping decode
worker hands its running sequences to another decode worker with the tokens streamed so
far (the prompt is recomputed there), so no answer is cut short.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry import trace

from tokenyard.bus import subjects
from tokenyard.fleet import resume_candidates
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.stream import TokenStream
from tokenyard.tracing import GEN_AI_USAGE_OUTPUT_TOKENS, REQUEST_ID, WORKER_ID, tracer
from tokenyard.v1 import serving_pb2 as pb

_tracer = tracer("tokenyard.worker")
log = logging.getLogger(__name__)


class DecodeHandler:
    def __init__(self, worker: WorkerBase) -> None:
        self.w = worker
        self.bus = worker.bus
        self.handoffs: dict[str, pb.DecodeHandoff] = {}  # running here
        self._tg: asyncio.TaskGroup | None = None
        self._sub: Subscription | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        self._sub = await self.bus.subscribe(
            subjects.decode_jobs(self.w.worker_id), pb.DecodeHandoff, self.on_handoff
        )

    async def on_handoff(self, handoff: pb.DecodeHandoff, msg: Msg) -> None:
        # NOTE: a subscription's callbacks run one at a time; the engine call inside would
        # serialize hand-offs behind engine steps, so each one gets its own task.
        assert self._tg is not None
        self._tg.create_task(self._take(handoff, msg), name=f"handoff {handoff.request_id}")

    async def _take(self, handoff: pb.DecodeHandoff, msg: Msg) -> None:
        rid = handoff.request_id
        refusal = self._refusal(handoff)
        if refusal:
            await self.bus.reply(
                msg, pb.HandoffAck(request_id=rid, accepted=False, message=refusal)
            )
            return
        try:
            stream, dst = await self.w.import_handoff(handoff)
        except Exception as exc:  # NoFreeBlocks, a bad sequence: the prefill worker keeps it
            await self.bus.reply(
                msg, pb.HandoffAck(request_id=rid, accepted=False, message=str(exc))
            )
            return
        self.handoffs[rid] = handoff
        stream.done.add_done_callback(lambda _: self.handoffs.pop(rid, None))
        await self.bus.reply(msg, pb.HandoffAck(request_id=rid, accepted=True))
        attributes = {REQUEST_ID: rid, WORKER_ID: self.w.worker_id}
        with _tracer.start_as_current_span("kv_transfer", attributes=attributes) as span:
            kv_ok = await self.w.kv.pull(handoff.kv_endpoint, rid, list(handoff.src_block_ids), dst)
            span.set_attributes({"kv.blocks": len(dst), "tokenyard.kv_ok": kv_ok})
        if stream.done.done():  # cancelled while we pulled
            return
        decode = _tracer.start_span("decode", attributes=attributes)
        stream.done.add_done_callback(lambda done: _end_decode_span(decode, stream, done))
        with trace.use_span(decode):
            await self.w.commit(rid, kv_ok=kv_ok)

    def _refusal(self, handoff: pb.DecodeHandoff) -> str:
        """Why this hand-off is not taken here ("" = it is)."""
        if not handoff.gateway_id:
            return "the hand-off names no gateway to stream its tokens to"
        taking = self.w.accepting.is_set() and not self.w.stopping.is_set()
        if not taking or self.w.is_cancelled(handoff.request_id):
            return "not taking work"
        return ""

    async def stop_taking(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def hand_over_running(self) -> None:
        """Move every sequence still running here to another live decode worker."""
        for rid, handoff in list(self.handoffs.items()):
            stream = self.w.streams.get(rid)
            if stream is None:
                continue
            await self.w.loop.abort(rid)
            resume = pb.DecodeHandoff()
            resume.CopyFrom(handoff)
            resume.ClearField("output_token_ids")
            resume.output_token_ids.extend(stream.output_token_ids)
            resume.kv_endpoint = ""
            resume.ClearField("src_block_ids")
            if await self._resume_elsewhere(resume):
                stream.hand_back()
            else:
                await stream.fail(
                    pb.Error.INTERNAL,
                    "the decode worker stopped and no other could take the request",
                )

    async def _resume_elsewhere(self, resume: pb.DecodeHandoff) -> bool:
        live = self.w.fleet.live(time.monotonic())
        for peer_id in resume_candidates(live, exclude=self.w.worker_id):
            try:
                ack = await self.bus.request(
                    subjects.decode_jobs(peer_id), resume, pb.HandoffAck, timeout=2.0
                )
            except Exception:
                continue
            if ack.accepted:
                log.info(
                    "handed %s (%d tokens in) to %s",
                    resume.request_id,
                    len(resume.output_token_ids),
                    peer_id,
                )
                return True
        return False


def _end_decode_span(span: trace.Span, stream: TokenStream, done: asyncio.Future[str]) -> None:
    span.set_attribute(GEN_AI_USAGE_OUTPUT_TOKENS, len(stream.output_token_ids))
    span.set_attribute("tokenyard.finish_reason", done.result() if not done.cancelled() else "")
    span.end()
