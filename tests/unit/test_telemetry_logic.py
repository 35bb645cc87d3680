"""The telemetry service's pure parts: OTLP spans to rows and request fields, windowed
percentiles, and the racks -> nodes -> workers tree."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tokenyard import tracing
from tokenyard.facilities.inventory import Inventory
from tokenyard.fleet import FleetView
from tokenyard.services.telemetry.fleet import PrefixCounts, fleet_tree
from tokenyard.services.telemetry.spans import ERROR_MESSAGE_MAX, request_fields, rows
from tokenyard.services.telemetry.stats import Finished, Window, percentile_or_none
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import FacilityReading, RackState, RackStateKind


def test_spans_become_rows_and_request_fields():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    with (
        tracer.start_as_current_span(
            "chat m",
            attributes={
                tracing.REQUEST_ID: "chatcmpl-1",
                tracing.GEN_AI_OPERATION: "chat",
                tracing.GEN_AI_REQUEST_MODEL: "m",
                tracing.GEN_AI_USAGE_INPUT_TOKENS: 7,
                tracing.GEN_AI_USAGE_OUTPUT_TOKENS: 3,
                tracing.GEN_AI_RESPONSE_FINISH_REASONS: ["stop"],
                tracing.GEN_AI_TTFT: 0.25,
            },
        ) as root,
        tracer.start_as_current_span(
            "router.route",
            attributes={
                tracing.REQUEST_ID: "chatcmpl-1",
                "tokenyard.prefill_worker": "p1",
                "tokenyard.decode_worker": "d1",
            },
        ),
    ):
        pass
    parsed = {r.name: r for r in rows(encode_spans(exporter.get_finished_spans()))}
    route, top = parsed["router.route"], parsed["chat m"]
    assert top.service == "gateway" and top.parent_span_id is None
    assert route.parent_span_id == format(root.get_span_context().span_id, "016x")
    assert route.trace_id == top.trace_id and top.request_id == "chatcmpl-1"
    fields = request_fields(top)
    assert fields["model"] == "m" and fields["finish_reason"] == "stop"
    assert (fields["prompt_tokens"], fields["output_tokens"], fields["ttft_s"]) == (7, 3, 0.25)
    assert request_fields(route) == {"prefill_worker": "p1", "decode_worker": "d1"}


def test_percentiles_and_the_window():
    assert percentile_or_none([], 50) is None
    assert percentile_or_none([3.0, 1.0, 2.0], 50) == 2.0
    # The bench's definition (linear interpolation, numpy's default), not the nearest rank.
    assert percentile_or_none([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)
    window = Window(window_s=10)
    window.add(
        Finished(
            at=100, ttft_s=0.2, duration_s=1.2, prompt_tokens=10, cached_tokens=5, output_tokens=11
        )
    )
    window.add(
        Finished(
            at=105, ttft_s=0.4, duration_s=0.4, prompt_tokens=10, cached_tokens=0, output_tokens=1
        )
    )
    f = window.figures(now=108)
    assert f["ttft_p50_s"] == pytest.approx(0.3) and f["ttft_p99_s"] == pytest.approx(0.398)
    assert f["itl_p50_s"] == 0.1  # (1.2 - 0.2) / 10; a 1-token request has no ITL
    assert f["prefix_hit_rate"] == 0.25 and f["requests_per_s"] == 0.2
    assert window.figures(now=112)["ttft_p50_s"] == 0.4  # the first one left the window


def test_the_fleet_tree_places_workers_by_inventory_and_colours_them():
    inventory = Inventory.model_validate(
        {
            "racks": [
                {
                    "name": "r1",
                    "cooling": "air",
                    "power_cap_kw": 8,
                    "nodes": [{"name": "n1", "gpus": 8, "gpu_tdp_w": 700, "workers": ["p1"]}],
                },
                {
                    "name": "r2",
                    "cooling": "air",
                    "power_cap_kw": 8,
                    "nodes": [{"name": "n2", "gpus": 8, "gpu_tdp_w": 700, "workers": ["d1"]}],
                },
            ]
        }
    )
    fleet, now = FleetView(), time.monotonic()
    for wid, role in (("p1", "prefill"), ("d1", "decode"), ("x9", "both")):
        hb = pb.WorkerHeartbeat(
            worker_id=wid,
            role=role,
            num_blocks=100,
            num_free_blocks=75,
            host="h",
            heartbeat_interval_ms=1000,
        )
        fleet.on_heartbeat(hb, now - (10 if wid == "d1" else 0))  # d1 went silent
    states = {"r1": RackState(rack="r1", state=RackStateKind.RACK_STATE_DRAIN, reason="pump")}
    readings = {"r1": FacilityReading(rack="r1", power_kw=3.5, flow_lpm=2.0)}
    tree = fleet_tree(fleet, now, inventory, states, readings, {"p1": PrefixCounts(100, 40)})
    assert [r["name"] for r in tree] == ["r1", "r2", "unplaced"]
    r1 = tree[0]
    assert (r1["state"], r1["power_kw"], r1["flow_lpm"], r1["supply_c"]) == (
        "drain",
        3.5,
        2.0,
        None,
    )
    p1 = r1["nodes"][0]["workers"][0]
    assert (p1["worker_id"], p1["state"], p1["kv_usage"], p1["prefix_hit_rate"]) == (
        "p1",
        "drain",
        0.25,
        0.4,
    )
    assert tree[1]["nodes"][0]["workers"][0]["state"] == "dead"
    assert tree[2]["nodes"][0] == {"name": "h", "workers": [tree[2]["nodes"][0]["workers"][0]]}
    assert tree[2]["nodes"][0]["workers"][0]["state"] == "normal"


def test_a_failed_requests_root_span_gives_its_error_code_and_message():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "gateway"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    attributes = {tracing.REQUEST_ID: "cmpl-9", tracing.GEN_AI_OPERATION: "text_completion"}
    with provider.get_tracer("t").start_as_current_span("text_completion m") as span:
        span.set_attributes(attributes | {tracing.ERROR_TYPE: "no_capacity"})
        span.set_status(StatusCode.ERROR, "no worker can prefill now " + "x" * 2000)
    with provider.get_tracer("t").start_as_current_span("text_completion m", attributes=attributes):
        pass
    failed, ok = rows(encode_spans(exporter.get_finished_spans()))
    fields = request_fields(failed)
    assert fields["status"] == "error" and fields["error_code"] == "no_capacity"
    assert fields["error_message"].startswith("no worker can prefill now")
    assert len(fields["error_message"]) == ERROR_MESSAGE_MAX  # what the column holds
    assert request_fields(ok)["status"] == "ok" and "error_code" not in request_fields(ok)
