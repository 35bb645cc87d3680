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


# Attribute names. The GenAI ones follow OpenTelemetry's semantic conventions for
# generative AI; REQUEST_ID is on every span of a request, so its id finds its trace.
REQUEST_ID = "tokenyard.request_id"
WORKER_ID = "tokenyard.worker_id"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_TTFT = "gen_ai.server.time_to_first_token"
ERROR_TYPE = "error.type"  # a failed request's error code (OpenTelemetry semantic conventions)


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC call metadata (W3C traceparent/tracestate)."""
    return tuple(inject_headers().items())


def grpc_context(servicer_context: object) -> Context:
    """The caller's trace context from a gRPC servicer context's invocation metadata."""
    metadata = servicer_context.invocation_metadata() or ()  # type: ignore[attr-defined]
    return propagate.extract({str(k): str(v) for k, v in metadata})
