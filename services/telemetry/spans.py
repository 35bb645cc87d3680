"""OTLP spans (as published on ty.telemetry.spans.*) to plain rows, and what a request's
spans say about it; pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from tokenyard import tracing

ERROR_MESSAGE_MAX = 1024  # tel_requests.error_message
_STATUS = {Status.STATUS_CODE_UNSET: "unset", Status.STATUS_CODE_OK: "ok"}


@dataclass(frozen=True)
class SpanRow:
    trace_id: str
    span_id: str
    parent_span_id: str | None
    service: str
    name: str
    start_unix_ns: int
    end_unix_ns: int
    status: str
    attributes: dict[str, Any]
    status_message: str = ""  # why, when the status is "error"

    @property
    def request_id(self) -> str | None:
        value = self.attributes.get(tracing.REQUEST_ID)
        return str(value) if value else None

    @property
    def duration_s(self) -> float:
        return (self.end_unix_ns - self.start_unix_ns) / 1e9

    @property
    def is_request_root(self) -> bool:
        """The gateway's span of a whole request (it has the GenAI operation)."""
        return tracing.GEN_AI_OPERATION in self.attributes


def value_of(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def rows(export: ExportTraceServiceRequest) -> list[SpanRow]:
    out = []
    for resource_spans in export.resource_spans:
        resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", "unknown"))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    SpanRow(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        service=service,
                        name=span.name,
                        start_unix_ns=span.start_time_unix_nano,
                        end_unix_ns=span.end_time_unix_nano,
                        status=_STATUS.get(span.status.code, "error"),
                        attributes={a.key: value_of(a.value) for a in span.attributes},
                        status_message=span.status.message,
                    )
                )
    return out


def request_fields(row: SpanRow) -> dict[str, Any]:
    """A request record's fields from one of its spans (None where this span does not say)."""
    a = row.attributes
    if row.is_request_root:
        finish = a.get(tracing.GEN_AI_RESPONSE_FINISH_REASONS) or [None]
        return {
            "trace_id": row.trace_id,
            "started_at": _utc(row.start_unix_ns),
            "operation": str(a.get(tracing.GEN_AI_OPERATION, "")),
            "model": str(a.get(tracing.GEN_AI_REQUEST_MODEL, "")),
            "status": "error" if row.status == "error" else "ok",
            "finish_reason": finish[0],
            "prompt_tokens": a.get(tracing.GEN_AI_USAGE_INPUT_TOKENS),
            "output_tokens": a.get(tracing.GEN_AI_USAGE_OUTPUT_TOKENS),
            "cached_tokens": a.get("tokenyard.cached_tokens"),
            "energy_joules": a.get("tokenyard.energy_joules"),
            "energy_source": a.get("tokenyard.energy_source"),
            "ttft_s": a.get(tracing.GEN_AI_TTFT),
            "duration_s": row.duration_s,
            **error_fields(row),
        }
    if row.name == "router.route":
        return {
            "prefill_worker": a.get("tokenyard.prefill_worker") or None,
            "decode_worker": a.get("tokenyard.decode_worker") or None,
        }
    return {}


def error_fields(row: SpanRow) -> dict[str, Any]:
    """A failed request's error code (OpenTelemetry's `error.type`) and message."""
    if row.status != "error":
        return {}
    code = row.attributes.get(tracing.ERROR_TYPE)
    message = row.status_message[:ERROR_MESSAGE_MAX] or None
    return {"error_code": str(code)[:64] if code else None, "error_message": message}


def _utc(unix_ns: int) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(unix_ns / 1e9, UTC)
