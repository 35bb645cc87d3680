"""Finished spans to the telemetry service over NATS, so the console shows traces without
a Jaeger or a collector.

    async with spans_to_bus(bus, "router"):   # after setup_tracing("router")
        ...

Spans travel as OTLP's own protobuf (`ExportTraceServiceRequest`), in batches, on
`ty.telemetry.spans.<service>`. This runs beside the OTLP exporter, which stays on when
OTEL_EXPORTER_OTLP_ENDPOINT is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 0.5
MAX_BATCH = 256
# NOTE: spans are for looking, not accounting: when NATS is slower than the spans come,
# the oldest are dropped rather than holding memory.
MAX_BUFFERED = 10_000


class BusSpanProcessor(SpanProcessor):
    """Buffers ended spans (from any thread); `flush()` publishes them on the event loop."""

    def __init__(self, bus: Bus, service: str) -> None:
        self.bus = bus
        self.subject = subjects.telemetry_spans(service)
        self.buffer: deque[ReadableSpan] = deque(maxlen=MAX_BUFFERED)
        self.open = True

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if self.open:
            self.buffer.append(span)

    def shutdown(self) -> None:
        self.open = False

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # flushed by `flush()` on the event loop

    async def flush(self) -> None:
        while self.buffer:
            batch = [self.buffer.popleft() for _ in range(min(MAX_BATCH, len(self.buffer)))]
            try:
                await self.bus.publish(self.subject, encode_spans(batch))
            except Exception:
                log.warning("dropped %d spans: publishing them failed", len(batch), exc_info=True)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), FLUSH_EVERY_S)
            await self.flush()


@contextlib.asynccontextmanager
async def spans_to_bus(bus: Bus, service: str) -> AsyncIterator[BusSpanProcessor | None]:
    """Publish this process's spans while the block runs (None: tracing is not set up here,
    as in tests that run a handler in-process)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        yield None
        return
    processor = BusSpanProcessor(bus, service)
    provider.add_span_processor(processor)
    stop = asyncio.Event()
    task = asyncio.create_task(processor.run(stop), name="spans-to-bus")
    try:
        yield processor
    finally:
        stop.set()
        await task
        processor.shutdown()
