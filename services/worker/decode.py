"""Decode role: take handed-off sequences, pull their KV, decode them with continuous batching.

Hand-offs arrive by core NATS request/reply on ``ty.decode.<worker>.jobs``; the reply
(HandoffAck) tells the prefill worker whether we took the sequence. A stopping decode
worker hands its running sequences to another decode worker with the tokens streamed so
far (the prompt is recomputed there), so no answer is cut short. What a hand-off does is
tokenyard.services.worker.handoff; this handler decides which ones are taken, and sends a
finished reply's KV blocks to the KV-cache service for a chat's next turn.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tokenyard.bus import subjects
from tokenyard.services.worker.base import WorkerBase
from tokenyard.v1 import serving_pb2 as pb


class DecodeHandler:
    def __init__(self, worker: WorkerBase) -> None:
        self.w = worker
        self.bus = worker.bus
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
        async def reply(ack: pb.HandoffAck) -> None:
            await self.bus.reply(msg, ack)

        refusal = self._refusal(handoff)
        if refusal:
            await reply(
                pb.HandoffAck(request_id=handoff.request_id, accepted=False, message=refusal)
            )
            return
        stream = await self.w.handoffs.take(handoff, reply)
        if stream is None:
            return
        # The reply's blocks are here only: the prefill worker offloaded the prompt's.
        reason = await stream.done
        prompt = list(handoff.prompt_token_ids)
        salt = handoff.params.cache_salt
        self.w.kvcache.offload_reply(
            handoff.request_id, prompt, stream.output_token_ids, salt, reason
        )

    def _refusal(self, handoff: pb.DecodeHandoff) -> str:
        """Why this hand-off is not taken here ("" = it is)."""
        if not handoff.gateway_id:
            return "the hand-off names no gateway to stream its tokens to"
        taking = self.w.accepting.is_set() and not self.w.stopping.is_set()
        if not taking or self.w.streams.is_cancelled(handoff.request_id):
            return "not taking work"
        return ""

    async def stop_taking(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
