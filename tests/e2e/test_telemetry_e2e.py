"""The telemetry service on a real stack (real model, NATS, SQLite, facilities): the fleet,
recent requests with their worker path, one request's trace, /metrics, and the admin
actions (a pump fault drains a rack; draining a worker)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.procs import wait_until
from tokenyard.services.launch.stack import LocalStack, StackConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tstack(launch_stack) -> Iterator[LocalStack]:
    config = StackConfig(
        port=free_port(),
        kvcache=False,
        router_env={"TOKENYARD_ROUTER_DISAGG_MIN_PROMPT_TOKENS": "0"},
    )
    with launch_stack(config) as stack:
        stack.wait_ready(timeout=300)
        assert wait_until(lambda: _get(stack, "/ready").status_code == 200, 60)
        yield stack


def _get(stack: LocalStack, path: str) -> httpx.Response:
    try:
        return httpx.get(f"{stack.console_url.rstrip('/')}{path}", timeout=10)
    except httpx.HTTPError:
        return httpx.Response(599)


def _admin(stack: LocalStack) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.console_admin_token}"}


def _workers(fleet: dict) -> dict[str, dict]:
    return {w["worker_id"]: w for r in fleet["racks"] for n in r["nodes"] for w in n["workers"]}


def test_fleet_requests_and_trace(tstack):
    fleet = _get(tstack, "/api/fleet").json()
    assert [r["name"] for r in fleet["racks"]] == ["rack-a", "rack-b"]
    workers = _workers(fleet)
    assert {"prefill-1", "decode-2"} <= set(workers)
    assert workers["prefill-1"]["role"] == "prefill" and workers["prefill-1"]["state"] == "normal"

    body = {"model": tstack.model_id, "prompt": "Count: one, two,", "max_tokens": 5}
    resp = httpx.post(f"{tstack.gateway_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200
    rid, usage = resp.headers["x-request-id"], resp.json()["usage"]

    def recorded() -> dict | None:
        rows = _get(tstack, "/api/requests").json()["requests"]
        row = next((r for r in rows if r["request_id"] == rid), None)
        return row if row and row["worker_path"] else None

    assert wait_until(lambda: recorded() is not None, 15)
    row = recorded()
    assert row["output_tokens"] == usage["completion_tokens"]
    assert row["prompt_tokens"] == usage["prompt_tokens"]
    assert row["worker_path"] == ["prefill-1", "decode-2"]
    assert row["ttft_s"] > 0 and row["duration_s"] >= row["ttft_s"]

    trace = _get(tstack, f"/api/requests/{rid}/trace").json()
    spans = {s["name"]: s for s in trace["spans"]}
    services = {s["service"] for s in trace["spans"]}
    assert {"gateway", "router", "worker-prefill", "worker-decode"} <= services
    root = spans[f"text_completion {tstack.model_id}"]
    assert root["parent_span_id"] is None and root["start_offset_s"] == 0
    assert spans["router.route"]["parent_span_id"] == root["span_id"]
    assert root["attributes"]["gen_ai.usage.output_tokens"] == usage["completion_tokens"]

    missing = _get(tstack, "/api/requests/cmpl-nope/trace")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "trace_not_found"

    metrics = _get(tstack, "/metrics").text
    assert 'tokenyard:fleet_workers{role="prefill",state="normal"} 1.0' in metrics
    assert "tokenyard:telemetry_spans_received_total" in metrics


def test_pump_fault_drains_the_rack_and_clears(tstack):
    url = tstack.console_url.rstrip("/")
    no_token = httpx.post(f"{url}/api/admin/racks/rack-a/faults", json={"kind": "pump_failure"})
    assert no_token.status_code == 401
    r = httpx.post(
        f"{url}/api/admin/racks/rack-a/faults",
        json={"kind": "pump_failure"},
        headers=_admin(tstack),
        timeout=10,
    )
    assert r.status_code == 200, r.text

    def rack_state(name: str) -> str:
        return next(x for x in _get(tstack, "/api/fleet").json()["racks"] if x["name"] == name)[
            "state"
        ]

    assert wait_until(lambda: rack_state("rack-a") == "drain", 15)
    assert _workers(_get(tstack, "/api/fleet").json())["prefill-1"]["state"] == "drain"
    assert rack_state("rack-b") == "normal"
    cleared = httpx.delete(
        f"{url}/api/admin/racks/rack-a/faults", headers=_admin(tstack), timeout=10
    )
    assert cleared.status_code == 200
    bad = httpx.post(
        f"{url}/api/admin/racks/rack-a/faults", json={"kind": 3}, headers=_admin(tstack)
    )
    assert bad.status_code == 400 and "error" in bad.json()


def test_drain_a_worker_from_the_console(tstack):
    url = tstack.console_url.rstrip("/")
    extra = tstack.add_worker("decode", worker_id="decode-9")
    assert wait_until(lambda: "decode-9" in _workers(_get(tstack, "/api/fleet").json()), 120)
    unknown = httpx.post(f"{url}/api/admin/workers/nobody/drain", headers=_admin(tstack))
    assert unknown.status_code == 404
    r = httpx.post(f"{url}/api/admin/workers/decode-9/drain", headers=_admin(tstack), timeout=10)
    assert r.status_code == 200 and r.json()["accepted"] is True
    assert wait_until(lambda: not extra.alive(), 60)
    assert wait_until(
        lambda: _workers(_get(tstack, "/api/fleet").json())["decode-9"]["state"] == "dead", 30
    )
