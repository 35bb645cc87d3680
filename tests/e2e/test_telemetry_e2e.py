"""The telemetry service on a real stack (real model, NATS, SQLite, facilities): the fleet,
recent requests with their worker path, one request's trace, /metrics, and the admin
actions (a pump fault drains a rack; draining a worker)."""

from __future__ import annotations

import httpx
import pytest

from tokenyard.services.launch.procs import wait_until
from tokenyard.services.launch.stack import LocalStack

pytestmark = pytest.mark.slow


def _get(stack: LocalStack, path: str) -> httpx.Response:
    try:
        return httpx.get(f"{stack.console_url.rstrip('/')}{path}", timeout=10)
    except httpx.HTTPError:
        return httpx.Response(599)


def _admin(stack: LocalStack) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.console_admin_token}"}


def _workers(fleet: dict) -> dict[str, dict]:
    return {w["worker_id"]: w for r in fleet["racks"] for n in r["nodes"] for w in n["workers"]}


def test_fleet_requests_and_trace(telemetry_stack):
    fleet = _get(telemetry_stack, "/api/fleet").json()
    assert [r["name"] for r in fleet["racks"]] == ["rack-a", "rack-b"]
    workers = _workers(fleet)
    assert {"prefill-1", "decode-2"} <= set(workers)
    assert workers["prefill-1"]["role"] == "prefill" and workers["prefill-1"]["state"] == "normal"

    body = {"model": telemetry_stack.model_id, "prompt": "Count: one, two,", "max_tokens": 5}
    resp = httpx.post(f"{telemetry_stack.gateway_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200
    rid, usage = resp.headers["x-request-id"], resp.json()["usage"]

    def recorded() -> dict | None:
        rows = _get(telemetry_stack, "/api/requests").json()["requests"]
        row = next((r for r in rows if r["request_id"] == rid), None)
        return row if row and row["worker_path"] else None

    assert wait_until(lambda: recorded() is not None, 15)
    row = recorded()
    assert row["output_tokens"] == usage["completion_tokens"]
    assert row["prompt_tokens"] == usage["prompt_tokens"]
    assert row["worker_path"] == ["prefill-1", "decode-2"]
    assert row["ttft_s"] > 0 and row["duration_s"] >= row["ttft_s"]

    # Each process publishes its finished spans every half second, from its own event loop,
    # so the workers' spans may reach the trace after the request row does.
    expected = {"gateway", "router", "worker-prefill", "worker-decode"}

    def trace_services() -> set[str]:
        trace = _get(telemetry_stack, f"/api/requests/{rid}/trace")
        return {s["service"] for s in trace.json()["spans"]} if trace.status_code == 200 else set()

    assert wait_until(lambda: expected <= trace_services(), 15), trace_services()
    trace = _get(telemetry_stack, f"/api/requests/{rid}/trace").json()
    spans = {s["name"]: s for s in trace["spans"]}
    root = spans[f"text_completion {telemetry_stack.model_id}"]
    assert root["parent_span_id"] is None and root["start_offset_s"] == 0
    assert spans["router.route"]["parent_span_id"] == root["span_id"]
    assert root["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]

    missing = _get(telemetry_stack, "/api/requests/cmpl-nope/trace")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "trace_not_found"

    metrics = _get(telemetry_stack, "/metrics").text
    assert 'tokenyard:fleet_workers{role="prefill",state="normal"} 1.0' in metrics
    assert "tokenyard:telemetry_spans_received_total" in metrics


def test_pump_fault_drains_the_rack_and_clears(telemetry_stack):
    url = telemetry_stack.console_url.rstrip("/")
    no_token = httpx.post(f"{url}/api/admin/racks/rack-a/faults", json={"kind": "pump_failure"})
    assert no_token.status_code == 401
    r = httpx.post(
        f"{url}/api/admin/racks/rack-a/faults",
        json={"kind": "pump_failure"},
        headers=_admin(telemetry_stack),
        timeout=10,
    )
    assert r.status_code == 200, r.text

    def rack_state(name: str) -> str:
        return next(
            x for x in _get(telemetry_stack, "/api/fleet").json()["racks"] if x["name"] == name
        )["state"]

    assert wait_until(lambda: rack_state("rack-a") == "drain", 15)
    assert _workers(_get(telemetry_stack, "/api/fleet").json())["prefill-1"]["state"] == "drain"
    assert rack_state("rack-b") == "normal"
    cleared = httpx.delete(
        f"{url}/api/admin/racks/rack-a/faults", headers=_admin(telemetry_stack), timeout=10
    )
    assert cleared.status_code == 200
    assert wait_until(lambda: rack_state("rack-a") == "normal", 30)
    bad = httpx.post(
        f"{url}/api/admin/racks/rack-a/faults", json={"kind": 3}, headers=_admin(telemetry_stack)
    )
    assert bad.status_code == 400 and "error" in bad.json()


def test_drain_a_worker_from_the_console(telemetry_stack):
    url = telemetry_stack.console_url.rstrip("/")
    extra = telemetry_stack.add_worker("decode", worker_id="decode-9")
    assert wait_until(
        lambda: "decode-9" in _workers(_get(telemetry_stack, "/api/fleet").json()), 120
    )
    unknown = httpx.post(f"{url}/api/admin/workers/nobody/drain", headers=_admin(telemetry_stack))
    assert unknown.status_code == 404
    r = httpx.post(
        f"{url}/api/admin/workers/decode-9/drain", headers=_admin(telemetry_stack), timeout=10
    )
    assert r.status_code == 200 and r.json()["accepted"] is True
    assert wait_until(lambda: not extra.alive(), 60)
    assert wait_until(
        lambda: _workers(_get(telemetry_stack, "/api/fleet").json())["decode-9"]["state"] == "dead",
        30,
    )
