"""LoRA adapters at the gateway: listed in /v1/models with their base as `parent`, a
request naming one runs on it (routed to its base model), and the admin API's loads and
unloads fan out to the workers, with each refusal's status and the worker named."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state, text_chunks

from tokenyard.services.gateway.app import create_app
from tokenyard.v1 import serving_pb2 as pb

TOKEN = "s3cret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
LOAD = {"lora_name": "sql", "lora_path": "/adapters/sql"}


def client(adapters: dict[str, list[str]], **settings: object) -> TestClient:
    """A gateway whose fleet is one live worker per id, holding the adapters given."""
    backend = FakeBackend()
    backend.script = text_chunks("ok")
    for worker_id, held in adapters.items():
        hb = pb.WorkerHeartbeat(worker_id=worker_id, model=MODEL, lora_adapters=held)
        hb.heartbeat_interval_ms = 60_000
        backend.fleet.on_heartbeat(hb, time.monotonic())
    state = fake_state(backend, admin_token=TOKEN, **settings)
    return TestClient(create_app(state.settings, state), raise_server_exceptions=False)


def test_models_lists_adapters_with_their_base_as_parent():
    with client({"w1": ["sql"], "w2": ["sql", "chat"]}) as http:
        data = http.get("/v1/models").json()["data"]
        cards = {m["id"]: m for m in data}
        assert list(cards) == [MODEL, "chat", "sql"]
        assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == "sql"
        assert cards[MODEL]["parent"] is None
        assert http.get("/v1/models/sql").json()["parent"] == MODEL


def test_a_request_naming_an_adapter_runs_on_it_and_an_unknown_one_is_404():
    with client({"w1": ["sql"]}) as http:
        body = {"model": "sql", "prompt": "hi", "max_tokens": 2}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "sql"
        [(_, model, _, params)] = http.app.state.gateway.backend.submitted
        assert (model, params.lora) == (MODEL, "sql")  # routed to the base, on the adapter
        r = http.post("/v1/completions", json={**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_load_fans_out_to_every_worker_and_the_adapter_is_served_at_once():
    with client({"w1": [], "w2": []}) as http:
        r = http.post("/v1/load_lora_adapter", json=LOAD, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["workers"] == ["w1", "w2"] and r.json()["parent"] == MODEL
        calls = http.app.state.gateway.backend.lora_calls
        assert {(w, c.action, c.lora_path) for w, c in calls} == {
            ("w1", pb.LoRAAdapterRequest.LOAD, "/adapters/sql"),
            ("w2", pb.LoRAAdapterRequest.LOAD, "/adapters/sql"),
        }
        assert "sql" in [m["id"] for m in http.get("/v1/models").json()["data"]]


def test_admin_endpoints_need_the_admin_token():
    with client({"w1": []}) as http:
        assert http.post("/v1/load_lora_adapter", json=LOAD).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http.post("/v1/load_lora_adapter", json=LOAD, headers=wrong).status_code == 403
        assert http.app.state.gateway.backend.lora_calls == []


def test_a_refusal_keeps_its_status_names_the_worker_and_undoes_the_others():
    for status, code in ((400, "invalid_lora_adapter"), (507, "lora_limit_reached")):
        with client({"w1": [], "w2": []}) as http:
            backend = http.app.state.gateway.backend
            message = "adapter 'sql': lora_A (4, 32) of another shape"
            backend.lora_replies["w2"] = pb.LoRAAdapterReply(status=status, message=message)
            r = http.post("/v1/load_lora_adapter", json=LOAD, headers=ADMIN)
            assert r.status_code == status
            error = r.json()["error"]
            assert error["code"] == code and error["message"] == f"worker w2: {message}"
            undo = [(w, c.action) for w, c in backend.lora_calls[2:]]
            assert undo == [("w1", pb.LoRAAdapterRequest.UNLOAD)]


def test_a_silent_worker_is_504_and_unloading_an_unknown_adapter_404():
    with client({"w1": []}) as http:
        http.app.state.gateway.backend.lora_replies["w1"] = None
        r = http.post("/v1/load_lora_adapter", json=LOAD, headers=ADMIN)
        assert r.status_code == 504 and "w1 did not answer" in r.json()["error"]["message"]
    with client({"w1": []}) as http:
        unknown = pb.LoRAAdapterReply(status=404, message="the LoRA adapter 'x' does not exist")
        http.app.state.gateway.backend.lora_replies["w1"] = unknown
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"


def test_unload_stops_listing_the_adapter():
    with client({"w1": ["sql"], "w2": []}) as http:
        backend = http.app.state.gateway.backend
        backend.lora_replies["w2"] = pb.LoRAAdapterReply(status=404, message="not here")
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["workers"] == ["w1"]
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]
        body = {"model": "sql", "prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 404
