"""OpenTelemetry set-up and trace-context propagation through NATS headers and gRPC metadata.

One request is one trace across services: the publisher injects the W3C `traceparent` into
the message headers, the subscriber extracts it and starts its span as a child.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.context import Context

_configured = False


def setup_tracing(service_name: str) -> None:
    """Install an SDK tracer provider; export over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set."""
    global _configured
    if _configured:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """The current trace context as message headers (W3C traceparent/tracestate)."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(dict(headers or {})) if headers else context.get_current()
