"""One request from prepared prompt to HTTP answer: streamed as SSE or assembled as JSON.

A client that goes away cancels its request on the workers: streams notice when the
server cancels the response generator, whole answers by polling the connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import propagate, trace
from pydantic import BaseModel

from tokenyard import tracing
from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.backend import TokenStream
from tokenyard.services.gateway.responses import Accumulator, ResponseFormat, energy_of
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
# Where a generating route leaves its request id for the x-request-id response header.
REQUEST_ID_SCOPE_KEY = "tokenyard.request_id"
# OpenTelemetry GenAI operation names of our routes.
OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat"}
_UINT64 = 1 << 64


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
    """Drives one request through the backend and records its metrics.

    With `n` (or `best_of`) > 1 each choice is its own sequence on the workers, `rid-i` for
    i > 0. The first is routed; the others go at once to the same workers, whose scheduler
    holds them while the first computes the prompt's blocks and then gives them those blocks
    from its prefix cache: the choices start together and the prompt is computed once.
    A batch of prompts (completions) is that for each prompt: sequence k generates for
    prompt k // best_of.
    """

    def __init__(
        self,
        state: GatewayState,
        route: str,
        prepared: Prepared,
        fmt: ResponseFormat,
        on_complete: Callable[[BaseModel], Awaitable[None]] | None = None,
    ) -> None:
        self.state, self.route, self.prepared, self.fmt = state, route, prepared, fmt
        # Called with the whole answer once it is known, before the client gets its end
        # (the Responses API stores it there: a client may continue it at once).
        self.on_complete = on_complete
        self.prompts = prepared.prompts
        num_seqs = len(self.prompts) * prepared.best_of
        self.accs = [Accumulator() for _ in range(num_seqs)]
        # NOTE: "-", not ".": a request id is one token of a NATS subject
        # (ty.tokens.<gw>.<id>.<worker>), and the bus permissions grant `ty.tokens.<gw>.*.*`.
        self.rids = [fmt.rid] + [f"{fmt.rid}-{i}" for i in range(1, num_seqs)]
        self.streams: list[TokenStream] = []
        self.t0 = time.perf_counter()
        self.first_token_at: float | None = None
        self.done = False
        self.error: ApiError | None = None  # what failed it, for its span

    async def serve(self, request: Request, model: str) -> Response:
        request.scope[REQUEST_ID_SCOPE_KEY] = self.fmt.rid
        # One trace per request (every choice in it): the bus carries this span's context to
        # router and workers. The span lasts until the answer's last byte (ended in _observe).
        self.span = _tracer.start_span(
            f"{OPERATIONS.get(self.route, self.route)} {model}",
            # The caller's trace when it sent a traceparent, else a new one.
            context=propagate.extract(dict(request.headers)),
            kind=trace.SpanKind.SERVER,
            attributes=self._request_attributes(model),
        )
        # A LoRA adapter's name routes to its base model's workers that hold it.
        model, self.prepared.params.lora = self.state.resolve_model(model)
        try:
            self.streams.append(await self._submit(model, 0))
        except BaseException as exc:
            self.span.record_exception(exc)
            if isinstance(exc, ApiError):
                self.span.set_attribute(tracing.ERROR_TYPE, error_type(exc))
            self.span.set_status(trace.StatusCode.ERROR, str(exc))
            self.span.end()
            raise
        self.state.metrics.in_flight.inc()
        handed_off = False  # once the SSE generator owns the streams, it cleans up
        try:
            # The other choices start now, not after the first token: see the class docstring.
            for i in range(1, len(self.rids)):
                self.streams.append(await self._submit(model, i, self._placement_for(i)))
            # The first chunk decides the status: a worker's refusal is still a 4xx here.
            first = await until_disconnect(request, anext(self.streams[0]))
            if self.prepared.stream:
                handed_off = True
                return StreamingResponse(self._sse(request, first), media_type="text/event-stream")
            self._add(0, first)
            await until_disconnect(request, self._collect())
            body = self.fmt.complete(self.accs, self.prepared.num_prompt_tokens)
            if self.on_complete is not None:
                await self.on_complete(body)
            return JSONResponse(body.model_dump())
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except ApiError as exc:  # a worker's refusal in the first chunk
            self.error = exc
            raise
        finally:
            if not handed_off:
                await self._finish()

    def _placement_for(self, index: int) -> pb.Placement | None:
        """Where sequence `index` goes: with its prompt's first sequence (routed itself)."""
        first = index - index % self.prepared.best_of
        return None if first == index else self.streams[first].placement

    async def _submit(
        self, model: str, index: int, placement: pb.Placement | None = None
    ) -> TokenStream:
        params = self.prepared.params
        if index and params.HasField("seed"):
            # Seeded sampling depends on (seed, position): each choice needs a seed of its own.
            params = pb.SamplingParams()
            params.CopyFrom(self.prepared.params)
            params.seed = (params.seed + index) % _UINT64
        with trace.use_span(self.span, end_on_exit=False):
            return await self.state.backend.submit(
                self.rids[index],
                model,
                self.prompts[index // self.prepared.best_of],
                params,
                placement,
            )

    async def _collect(self) -> None:
        async for index, chunk in _merged(self.streams):
            self._add(index, chunk)
        self.done = True

    def _add(self, index: int, chunk: pb.TokenChunk) -> None:
        if self.first_token_at is None and chunk.token_ids:
            self.first_token_at = time.perf_counter()
            self.state.metrics.ttft.labels(self.route).observe(self.first_token_at - self.t0)
        self.accs[index].add(chunk)

    async def _sse(self, request: Request, first: pb.TokenChunk) -> AsyncIterator[str]:
        try:
            for event in self.fmt.start():
                yield event
            self._add(0, first)
            for event in self.fmt.events(first, 0):
                yield event
            async for index, chunk in _merged(self.streams, request):
                self._add(index, chunk)
                for event in self.fmt.events(chunk, index):
                    yield event
            self.done = True
            if self.on_complete is not None:
                await self.on_complete(
                    self.fmt.complete(self.accs, self.prepared.num_prompt_tokens)
                )
            for event in self.fmt.end(self.accs, self.prepared.num_prompt_tokens):
                yield event
        except ApiError as exc:
            # NOTE: the 200 status line is already sent; the error travels as the last event.
            # A timeout leaves the request running on a worker: _finish cancels it there.
            self.done = exc.status != 504
            self.error = exc
            log.warning("request %s failed mid-stream: %s", self.fmt.rid, exc.message)
            yield exc.sse()
        except ClientGone:
            log.info("client left request %s; cancelling it", self.fmt.rid)
        finally:
            await self._finish()

    async def _finish(self) -> None:
        # Shielded: this also runs while the server cancels a stream whose client left.
        with anyio.CancelScope(shield=True):
            if not self.done:
                self.state.metrics.cancelled.inc()
                for rid in self.rids[: len(self.streams)]:
                    await self.state.backend.cancel(rid, "client disconnected")
            for stream in self.streams:
                await stream.close()
            self._observe()

    def _request_attributes(self, model: str) -> dict[str, str | int | float]:
        params = self.prepared.params
        user = {"enduser.id": self.prepared.user} if self.prepared.user else {}
        return {
            **user,  # OpenTelemetry's name for the caller's end user
            "gen_ai.request.choice.count": self.prepared.n,
            tracing.REQUEST_ID: self.fmt.rid,
            tracing.GEN_AI_OPERATION: OPERATIONS.get(self.route, self.route),
            tracing.GEN_AI_PROVIDER: "tokenyard",
            tracing.GEN_AI_REQUEST_MODEL: model,
            tracing.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
            tracing.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            tracing.GEN_AI_REQUEST_TOP_P: params.top_p,
            tracing.GEN_AI_RESPONSE_ID: self.fmt.rid,
            "gen_ai.request.stream": self.prepared.stream,
        }

    def _end_span(self) -> None:
        accs, span = self.accs, self.span
        span.set_attribute(tracing.GEN_AI_USAGE_INPUT_TOKENS, self.prepared.num_prompt_tokens)
        span.set_attribute(
            tracing.GEN_AI_USAGE_OUTPUT_TOKENS, sum(a.num_output_tokens for a in accs)
        )
        span.set_attribute("tokenyard.cached_tokens", max(a.num_cached_tokens for a in accs))
        energy = energy_of(accs).reported()
        if energy is not None:
            span.set_attribute("tokenyard.energy_joules", energy[0])
            span.set_attribute("tokenyard.energy_source", energy[1])
        reasons = [a.finish_reason for a in accs if a.finish_reason]
        if reasons:
            span.set_attribute(tracing.GEN_AI_RESPONSE_FINISH_REASONS, reasons)
        if self.first_token_at is not None:
            span.set_attribute(tracing.GEN_AI_TTFT, self.first_token_at - self.t0)
        if self.error is not None:
            span.set_attribute(tracing.ERROR_TYPE, error_type(self.error))
            span.set_status(trace.StatusCode.ERROR, self.error.message)
        elif not self.done:
            span.set_status(trace.StatusCode.ERROR, "client disconnected")
        span.end()

    def _observe(self) -> None:
        self._end_span()
        m = self.state.metrics
        m.in_flight.dec()
        if self.done:
            m.e2e.labels(self.route).observe(time.perf_counter() - self.t0)
        m.prompt_tokens.inc(self.prepared.num_prompt_tokens)
        m.completion_tokens.inc(sum(a.num_output_tokens for a in self.accs))
        m.cached_tokens.inc(max(a.num_cached_tokens for a in self.accs))


def error_type(exc: ApiError) -> str:
    """The error's code as the client saw it (its HTTP status when it has none)."""
    return exc.code or str(exc.status)


async def _merged(
    streams: list[TokenStream], request: Request | None = None
) -> AsyncIterator[tuple[int, pb.TokenChunk]]:
    """(choice index, chunk) from every stream, as they come; one stream needs no tasks."""
    if len(streams) == 1:
        source = _watched(request, streams[0]) if request else streams[0]
        async for chunk in source:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, pb.TokenChunk | None | BaseException]] = asyncio.Queue()

    async def pump(index: int, stream: TokenStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            get = queue.get()
            index, item = await (until_disconnect(request, get) if request else get)
            if isinstance(item, BaseException):
                raise item
            if item is None:
                open_streams -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
