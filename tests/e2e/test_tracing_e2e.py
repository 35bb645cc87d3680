"""One request is one trace: the gateway's span is the root, the router's and the workers'
spans are its descendants, and every span carries the request id (x-request-id).
Spans are read as the telemetry service reads them: OTLP protobuf on ty.telemetry.spans.*."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus

pytestmark = pytest.mark.slow


async def collect_spans(bus: Bus, into: list[tuple[str, object]]) -> None:
    async def on_spans(export: ExportTraceServiceRequest, _msg: object) -> None:
        for resource_spans in export.resource_spans:
            service = next(
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            )
            for scope_spans in resource_spans.scope_spans:
                into.extend((service, span) for span in scope_spans.spans)

    await bus.subscribe(subjects.TELEMETRY_SPANS_ALL, ExportTraceServiceRequest, on_spans)


def attribute(span, key: str):
    for a in span.attributes:
        if a.key == key:
            return a.value.string_value or a.value.int_value
    return None


EXPECTED = {"router.route", "queue", "prefill", "handoff", "kv_transfer", "decode"}


async def test_one_request_is_one_parented_trace(stack):
    # Both workers ready (a session stack's worker may still be busy from an earlier test):
    # with no ready decode worker the router runs even a forced split aggregated.
    await asyncio.to_thread(stack.wait_ready, 120)
    bus = await Bus.connect(stack.nats_url, name="trace-test")
    seen: list[tuple[str, object]] = []
    try:
        await collect_spans(bus, seen)
        body = {"model": stack.model_id, "prompt": "The sky is", "max_tokens": 4}
        async with httpx.AsyncClient(timeout=120) as client:
            resp = await client.post(f"{stack.gateway_url}/v1/completions", json=body)
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        assert rid == resp.json()["id"]

        def mine():
            return [(s, span) for s, span in seen if attribute(span, "tokenyard.request_id") == rid]

        # Each service publishes its spans on its own clock (every 0.5 s from its event loop),
        # so the decode worker's can arrive before the prefill worker's: wait for them all.
        wanted = EXPECTED | {f"text_completion {stack.model_id}"}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and wanted - {span.name for _, span in mine()}:
            await asyncio.sleep(0.1)
    finally:
        await bus.close()
    spans = mine()
    by_name = {span.name: (service, span) for service, span in spans}
    assert wanted <= set(by_name), sorted(by_name)
    root_service, root = by_name[f"text_completion {stack.model_id}"]
    assert root_service == "gateway" and not root.parent_span_id
    assert attribute(root, "gen_ai.usage.output_tokens") == 4
    assert attribute(root, "gen_ai.request.model") == stack.model_id
    assert {span.trace_id for _, span in spans} == {root.trace_id}
    assert by_name["router.route"][0] == "router"
    assert by_name["router.route"][1].parent_span_id == root.span_id
    assert by_name["prefill"][0] == "worker-prefill"
    assert by_name["decode"][0] == "worker-decode"
    ids = {span.span_id for _, span in spans}
    assert all(span.parent_span_id in ids for _, span in spans if span is not root)
