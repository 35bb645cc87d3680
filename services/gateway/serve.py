"""One request from prepared prompt to HTTP answer: streamed as SSE or assembled as JSON.

A client that goes away cancels its request on the workers: streams notice when the
server cancels the response generator, whole answers by polling the connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tokenyard.services.gateway.backend import TokenStream
from tokenyard.services.gateway.errors import OpenAIError
from tokenyard.services.gateway.responses import Accumulator, ResponseFormat
from tokenyard.services.gateway.state import GatewayState
from tokenyard.services.gateway.translate import Prepared
from tokenyard.tracing import tracer
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)
_tracer = tracer("tokenyard.gateway")

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25
# Status logged for a request whose client left before the answer (nginx's convention).
CLIENT_CLOSED = 499


class ClientGone(Exception):
    pass


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but give up (ClientGone) as soon as the client closes the connection."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class Generation:
    """Drives one request through the backend and records its metrics."""

    def __init__(
        self, state: GatewayState, route: str, prepared: Prepared, fmt: ResponseFormat
    ) -> None:
        self.state, self.route, self.prepared, self.fmt = state, route, prepared, fmt
        self.acc = Accumulator()
        self.t0 = time.perf_counter()
        self.first_token_at: float | None = None
        self.done = False

    async def serve(self, request: Request, model: str) -> Response:
        rid, backend = self.fmt.rid, self.state.backend
        # One trace per request: the bus carries this span's context to router and workers.
        with _tracer.start_as_current_span(f"gateway.{self.route}", attributes={"request_id": rid}):
            stream = await backend.submit(
                rid, model, self.prepared.prompt_ids, self.prepared.params
            )
        self.state.metrics.in_flight.inc()
        handed_off = False  # once the SSE generator owns the stream, it cleans up
        try:
            if self.prepared.stream:
                # The first chunk decides the status: a worker's refusal is still a 4xx here.
                first = await until_disconnect(request, anext(stream))
                handed_off = True
                return StreamingResponse(
                    self._sse(request, first, stream), media_type="text/event-stream"
                )
            await until_disconnect(request, self._collect(stream))
            body = self.fmt.complete(self.acc, len(self.prepared.prompt_ids))
            return JSONResponse(body.model_dump())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not handed_off:
                await self._finish(stream)

    async def _collect(self, stream: TokenStream) -> None:
        async for chunk in stream:
            self._add(chunk)
        self.done = True

    def _add(self, chunk: pb.TokenChunk) -> None:
        if self.first_token_at is None and chunk.token_ids:
            self.first_token_at = time.perf_counter()
            self.state.metrics.ttft.labels(self.route).observe(self.first_token_at - self.t0)
        self.acc.add(chunk)

    async def _sse(
        self, request: Request, first: pb.TokenChunk, stream: TokenStream
    ) -> AsyncIterator[str]:
        try:
            for event in self.fmt.start():
                yield event
            async for chunk in _prepend(first, _watched(request, stream)):
                self._add(chunk)
                for event in self.fmt.events(chunk):
                    yield event
            self.done = True
            for event in self.fmt.end(self.acc, len(self.prepared.prompt_ids)):
                yield event
        except OpenAIError as exc:
            # NOTE: the 200 status line is already sent; the error travels as the last event.
            # A timeout leaves the request running on a worker: _finish cancels it there.
            self.done = exc.status != 504
            log.warning("request %s failed mid-stream: %s", self.fmt.rid, exc.message)
            yield exc.sse()
        except ClientGone:
            log.info("client left request %s; cancelling it", self.fmt.rid)
        finally:
            await self._finish(stream)

    async def _finish(self, stream: TokenStream) -> None:
        # Shielded: this also runs while the server cancels a stream whose client left.
        with anyio.CancelScope(shield=True):
            if not self.done:
                self.state.metrics.cancelled.inc()
                await self.state.backend.cancel(self.fmt.rid, "client disconnected")
            await stream.close()
            self._observe()

    def _observe(self) -> None:
        m = self.state.metrics
        m.in_flight.dec()
        if self.done:
            m.e2e.labels(self.route).observe(time.perf_counter() - self.t0)
        m.prompt_tokens.inc(len(self.prepared.prompt_ids))
        m.completion_tokens.inc(self.acc.num_output_tokens)
        m.cached_tokens.inc(self.acc.num_cached_tokens)


async def _watched(request: Request, stream: TokenStream) -> AsyncIterator[pb.TokenChunk]:
    """The stream's chunks, ending (ClientGone) when the client leaves.

    NOTE: a server on ASGI 2.4 tells a streaming response of a disconnect only when a write
    fails; while a slow worker sends nothing, only polling the connection notices it.
    """
    while True:
        try:
            if stream.has_chunk():  # the common case while tokens flow: no race to set up
                yield await anext(stream)
            else:
                yield await until_disconnect(request, anext(stream))
        except StopAsyncIteration:
            return


async def _prepend(first: pb.TokenChunk, rest: TokenStream) -> AsyncIterator[pb.TokenChunk]:
    yield first
    async for chunk in rest:
        yield chunk
