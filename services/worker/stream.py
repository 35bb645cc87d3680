"""One request's token stream: engine outputs in, TokenChunks out on
``ty.tokens.<gateway>.<rid>.<worker>`` (the prefix of the gateway that waits for them, then
this worker's id: the gateway takes a request's chunks only from the request's workers)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.outputs import RequestOutput
from tokenyard.services.worker.convert import error_chunk, token_chunk
from tokenyard.services.worker.metrics import RequestTimer
from tokenyard.v1 import serving_pb2 as pb

# A stream ended by a stopping worker without telling the gateway: someone else continues it.
HANDED_BACK = "handed-back"


class TokenStream:
    """Publishes each step's tokens at their output index; ``done`` resolves with the
    finish reason ("stop", "length", "abort", "prefilled", "error")."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        gateway_id: str,
        request_id: str,
        decode: Callable[[list[int]], str],
        *,
        start_index: int = 0,
        cached_tokens: int | None = None,
        timer: RequestTimer | None = None,
    ) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.request_id = request_id
        self.subject = subjects.tokens(gateway_id, request_id, worker_id)
        self.decode = decode
        self.next_index = start_index
        self.cached_tokens = cached_tokens
        self.output_token_ids: list[int] = []
        # Every chunk sent, kept for a gateway that asks for them again (`replay`): core NATS
        # drops what is published while a subscriber's server restarts.
        self.sent: list[pb.TokenChunk] = []
        self.timer = timer
        self.done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # Called once, with the first output: the prompt is computed and its blocks cached.
        self.on_prompt_computed: Callable[[], None] | None = None
        # (unix ns, tokens) per engine step that gave this request tokens: its step spans.
        self.output_times: list[tuple[int, int]] = []
        # Run for a work-queue job: handed back, the job goes back to the queue (nak) and
        # the router places it again. A hand-off or a resume has no such way back.
        self.from_job = False

    async def on_output(self, out: RequestOutput) -> None:
        chunk = token_chunk(
            out,
            index=self.next_index,
            worker_id=self.worker_id,
            decode=self.decode,
            cached_tokens=self.cached_tokens,
        )
        if self.cached_tokens is None:
            self.cached_tokens = out.num_cached_tokens
        if self.on_prompt_computed is not None:
            hook, self.on_prompt_computed = self.on_prompt_computed, None
            hook()
        self.output_times.append((time.time_ns(), len(out.new_token_ids)))
        self.next_index += len(out.new_token_ids)
        self.output_token_ids.extend(out.new_token_ids)
        if self.timer is not None:
            self.timer.on_tokens(len(out.new_token_ids))
        await self._send(chunk)
        if out.finished:
            self._finish(out.finish_reason or "stop")

    async def fail(self, code: pb.Error.Code, message: str) -> None:
        chunk = error_chunk(self.request_id, self.next_index, self.worker_id, code, message)
        await self._send(chunk)
        self._finish("error")

    async def aborted(self) -> None:
        """The request was cancelled: tell the gateway it ended (it may still be listening)."""
        chunk = error_chunk(
            self.request_id, self.next_index, self.worker_id, pb.Error.CODE_UNSPECIFIED, ""
        )
        chunk.finish_reason = "abort"
        chunk.ClearField("error")
        await self._send(chunk)
        self._finish("abort")

    async def replay(self, from_index: int) -> int:
        """Publish again the chunks sent from output index `from_index` on; how many."""
        again = [c for c in self.sent if c.index >= from_index]
        for chunk in again:
            await self.bus.publish(self.subject, chunk)
        return len(again)

    async def _send(self, chunk: pb.TokenChunk) -> None:
        self.sent.append(chunk)
        await self.bus.publish(self.subject, chunk)

    def hand_back(self) -> None:
        self._finish(HANDED_BACK)

    async def handed_to(self, taker: str) -> None:
        """The request goes on on worker `taker`: tell the gateway, which takes chunks only
        from the workers a request was placed on or handed to, then stop here."""
        notice = pb.TokenChunk(
            request_id=self.request_id,
            index=self.next_index,
            worker_id=self.worker_id,
            handed_to=taker,
        )
        await self.bus.publish(self.subject, notice)
        self.hand_back()

    def _finish(self, reason: str) -> None:
        if self.done.done():
            return
        # "prefilled" and handed-back requests end on another worker, which counts them.
        if self.timer is not None and reason not in ("prefilled", HANDED_BACK):
            self.timer.on_finish(reason)
        self.done.set_result(reason)
