"""The OpenAPI document is what the server does: every route is listed, every listed route
answers, and real answers validate against the schemas the document names."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from gateway_fakes import MODEL, documented_model, fake_state

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.responses_api.store import ResponseStore

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 4}


def client() -> TestClient:
    state = fake_state()
    state.responses = ResponseStore.open(None, retention_s=3600)
    return TestClient(create_app(state.settings, state), raise_server_exceptions=False)


def test_every_route_is_documented_and_answers():
    with client() as http:
        doc = http.get("/openapi.json").json()
        assert set(doc["paths"]) == {
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/input_items",
            "/v1/embeddings",
            "/v1/models",
            "/v1/models/{model}",
            "/v1/load_lora_adapter",
            "/v1/unload_lora_adapter",
            "/tokenize",
            "/detokenize",
            "/health",
            "/ready",
            "/metrics",
        }
        stored = http.post("/v1/responses", json=RESPONSE).json()["id"]
        for path, item in doc["paths"].items():
            for method in item:
                concrete = path.replace("{model}", MODEL).replace("{response_id}", stored)
                r = http.request(method, concrete, json=CHAT | {"prompt": "x"})
                assert r.status_code not in (404, 405), (method, path)
                assert str(r.status_code) in item[method]["responses"], (
                    method,
                    path,
                    r.status_code,
                )
        assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_answers_validate_against_documented_schemas():
    with client() as http:
        doc = http.get("/openapi.json").json()
        cases = [
            ("post", "/v1/chat/completions", CHAT, 200),
            ("post", "/v1/completions", {"model": MODEL, "prompt": "x"}, 200),
            ("post", "/v1/chat/completions", CHAT | {"logit_bias": {"x": 1}}, 400),
            ("post", "/v1/completions", {"model": "nope", "prompt": "x"}, 404),
            ("post", "/v1/responses", RESPONSE, 200),
            ("post", "/v1/responses", RESPONSE | {"background": True}, 400),
            ("get", "/v1/models", None, 200),
            ("post", "/v1/embeddings", {"model": MODEL, "input": "x"}, 503),  # no vector came
            ("post", "/tokenize", {"prompt": "x"}, 200),
            ("post", "/tokenize", {"model": "nope", "prompt": "x"}, 404),
            ("post", "/detokenize", {"tokens": [120]}, 200),
            ("get", "/health", None, 200),
            ("get", "/ready", None, 503),
        ]
        for method, path, body, status in cases:
            r = http.request(method, path, json=body)
            assert r.status_code == status, (path, r.text)
            documented_model(doc, method, path, status).model_validate(r.json())
        r = http.get("/v1/responses/resp_missing")
        assert r.status_code == 404, r.text
        documented_model(doc, "get", "/v1/responses/{response_id}", 404).model_validate(r.json())


def test_stream_events_validate_against_documented_event_schema():
    with client() as http:
        doc = http.get("/openapi.json").json()
        for path, body in [
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"model": MODEL, "prompt": "x"}),
        ]:
            model = documented_model(doc, "post", path, 200, "text/event-stream")
            r = http.post(
                path, json=body | {"stream": True, "stream_options": {"include_usage": True}}
            )
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [
                line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")
            ]
            assert events[-1] == "[DONE]"
            for event in events[:-1]:
                model.model_validate(json.loads(event))


def test_responses_stream_events_validate_against_documented_event_schema():
    with client() as http:
        doc = http.get("/openapi.json").json()
        model = documented_model(doc, "post", "/v1/responses", 200, "text/event-stream")
        r = http.post("/v1/responses", json=RESPONSE | {"stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [
            json.loads(line[len("data: ") :])
            for line in r.text.splitlines()
            if line.startswith("data: ")
        ]
        assert events[0]["type"] == "response.created"
        assert events[-1]["type"] == "response.completed"
        for event in events:
            model.model_validate(event)
        stored = http.get(f"/v1/responses/{events[-1]['response']['id']}").json()
        documented_model(doc, "get", "/v1/responses/{response_id}", 200).model_validate(stored)
        assert stored == events[-1]["response"]
