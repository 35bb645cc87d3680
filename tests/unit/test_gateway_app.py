"""The gateway app end to end over ASGI with a fake backend: the official client, errors, auth,
rate limits, cancellation, /ready, /metrics and the OpenAPI document. No network."""

from __future__ import annotations

import asyncio
import json
import time

import openai
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state, text_chunks

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.ratelimit import MemoryBuckets
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.v1 import serving_pb2 as pb

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


def make_client(state) -> TestClient:
    return TestClient(create_app(state.settings, state), raise_server_exceptions=False)


@pytest.fixture
def http(backend):
    with make_client(fake_state(backend)) as client:
        yield client


@pytest.fixture
def oai(http) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
    )


def test_chat_with_official_client(oai, backend):
    backend.script = text_chunks("Hello!", logprobs=True, cached=2)
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=1,
        seed=3,
    )
    assert out.choices[0].message.content == "Hello!"
    assert out.choices[0].finish_reason == "stop"
    assert [t.token for t in out.choices[0].logprobs.content] == list("Hello!")
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == 5
    assert out.usage.prompt_tokens_details.cached_tokens == 2
    _, model, _, params = backend.submitted[0]
    assert model == MODEL and params.max_tokens == 6 and params.seed == 3 and params.logprobs == 1


def test_chat_stream_with_official_client(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 11


def test_completions_with_official_client(oai):
    out = oai.completions.create(model=MODEL, prompt="say", max_tokens=11, logprobs=2)
    assert out.choices[0].text == "Hello world"
    assert out.choices[0].logprobs is not None
    streamed = list(oai.completions.create(model=MODEL, prompt="say", max_tokens=11, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "Hello world"


def test_vllm_extensions_through_extra_body(oai, backend):
    oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        extra_body={"top_k": 4, "min_p": 0.2, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    params = backend.submitted[0][3]
    assert (
        params.top_k == 4 and params.ignore_eos and params.repetition_penalty == pytest.approx(1.1)
    )


def test_models(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "messages": []}, "messages"),
        ({**CHAT, "response_format": {"type": "xml"}}, "response_format"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "logit_bias": {"x": 1}}, "logit_bias"),
        ({**CHAT, "guided_regex": "(["}, "guided_regex"),
        ({**CHAT, "temperature": 5}, "temperature"),
        ({**CHAT, "top_p": -1}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": 10_000}, "max_tokens"),
        ({**CHAT, "stop": 3}, "stop"),
        ({"model": MODEL}, "messages"),
        ({**CHAT, "messages": [{"role": "user", "content": "x" * 1000}]}, "messages"),
    ],
)
def test_bad_chat_requests_are_400_in_openai_shape(http, body, param):
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_prompt_too_long_names_the_limit(http):
    error = assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 500}), 400, "prompt"
    )
    assert "256" in error["message"] and error["code"] == "context_length_exceeded"


def test_malformed_json_is_422_in_openai_shape(http):
    r = http.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(r, 422)


def test_unknown_model_and_route_are_404(http):
    assert (
        assert_error(
            http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "model"
        )["code"]
        == "model_not_found"
    )
    assert_error(http.get("/v1/nothing"), 404)


def test_no_workers_is_503_with_retry_after(backend, http):
    backend.submit_error = ApiError(503, "no workers", code="no_workers", retry_after_s=2)
    r = http.post("/v1/chat/completions", json=CHAT)
    assert_error(r, 503)
    assert r.headers["retry-after"] == "2"


def test_worker_refusal_is_a_status_even_when_streaming(backend, http):
    backend.script = [
        pb.TokenChunk(index=0, finished=True, error=pb.Error(code=1, message="bad seed"))
    ]
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "stream": True}), 400)


def test_api_keys():
    with make_client(fake_state(api_keys=["k1", "k2"])) as http:
        assert_error(http.post("/v1/chat/completions", json=CHAT), 401)
        assert_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        ok = http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200  # operations stay open


def test_rate_limit_is_429_with_retry_after():
    now = [0.0]
    limiter = MemoryBuckets(rate=0.5, burst=2, clock=lambda: now[0])
    with make_client(fake_state(limiter=limiter)) as http:
        assert [http.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)] == [
            200,
            200,
        ]
        r = http.post("/v1/chat/completions", json=CHAT)
        assert_error(r, 429)
        assert r.headers["retry-after"] == "2"
        now[0] += 2.0
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_unexpected_error_is_500_in_openai_shape(backend, http):
    backend.submit_error = RuntimeError("boom")  # type: ignore[assignment]
    assert_error(http.post("/v1/chat/completions", json=CHAT), 500)


def test_finished_requests_are_not_cancelled(backend, oai):
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    list(
        oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert backend.cancelled == [] and all(s.closed for s in backend.streams)


def test_ready_reports_workers(backend, http):
    r = http.get("/ready")
    assert r.status_code == 503 and r.json()["reason"] == "no live worker can prefill"
    backend.fleet.on_heartbeat(
        pb.WorkerHeartbeat(worker_id="p1", role="prefill", model=MODEL), time.monotonic()
    )
    assert http.get("/ready").json()["reason"] == "no live worker can decode"
    backend.fleet.on_heartbeat(
        pb.WorkerHeartbeat(worker_id="d1", role="decode", model=MODEL), time.monotonic()
    )
    body = http.get("/ready").json()
    assert body["ready"] and body["roles"] == {"prefill": 1, "decode": 1}
    assert {w["worker_id"] for w in body["workers"]} == {"p1", "d1"}


def test_ready_counts_only_workers_that_say_they_can_take_work(backend, http):
    missing = "its JetStream consumer prefill-p1 is missing"
    for worker_id, role, not_ready in (("p1", "prefill", missing), ("d1", "decode", "")):
        beat = pb.WorkerHeartbeat(worker_id=worker_id, role=role, model=MODEL, not_ready=not_ready)
        backend.fleet.on_heartbeat(beat, time.monotonic())
    r = http.get("/ready")
    assert r.status_code == 503
    assert r.json()["reason"] == f"no live worker can prefill (p1: {missing})"
    backend.fleet.on_heartbeat(
        pb.WorkerHeartbeat(worker_id="p1", role="prefill", model=MODEL), time.monotonic()
    )
    assert http.get("/ready").status_code == 200


def test_metrics_count_requests_and_tokens(oai, http):
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
    text = http.get("/metrics").text
    assert 'tokenyard_gateway_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'tokenyard_gateway_requests_total{route="/v1/chat/completions",status="400"} 1.0' in text
    assert "tokenyard_gateway_completion_tokens_total 11.0" in text
    assert 'tokenyard_gateway_ttft_seconds_count{route="chat"} 1.0' in text


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("TOKENYARD_GATEWAY_API_KEYS", "a, b")
    monkeypatch.setenv("TOKENYARD_GATEWAY_PORT", "9001")
    settings = GatewaySettings()
    assert settings.api_keys == ["a", "b"] and settings.port == 9001


async def call_and_leave(app, body: dict, leave_after_body_messages: int) -> list[dict]:
    """Drive the ASGI app like a server whose client closes the connection after receiving
    `leave_after_body_messages` body messages (0 = before any answer)."""
    sent: list[dict] = []
    left = asyncio.Event()
    payload = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
        "root_path": "",
    }
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if left.is_set():
            return  # the connection is gone: the server drops what is sent
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= leave_after_body_messages:
            left.set()

    if leave_after_body_messages == 0:
        left.set()
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), 5)
    return sent


@pytest.mark.parametrize("stream", [True, False])
async def test_client_that_leaves_a_slow_request_cancels_it(stream):
    backend = FakeBackend(hang=True)
    state = fake_state(backend)
    app = create_app(state.settings, state)
    t0 = time.monotonic()
    await call_and_leave(
        app, {**CHAT, "stream": stream}, leave_after_body_messages=2 if stream else 0
    )
    assert time.monotonic() - t0 < 2  # noticed while the worker sends nothing
    assert backend.cancelled == [backend.submitted[0][0]]
    assert backend.streams[0].closed
    assert state.metrics.in_flight._value.get() == 0


@pytest.mark.parametrize(
    "raw",
    [
        b"null",
        b"[]",
        b'"text"',
        b"{}",
        b'{"model": 5, "messages": "hi"}',
        json.dumps({**CHAT, "max_tokens": 1e30}).encode(),
        json.dumps({**CHAT, "seed": 2**70}).encode(),
        json.dumps({**CHAT, "stop": ["s"] * 100}).encode(),
        json.dumps(
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            }
        ).encode(),
        json.dumps({**CHAT, "messages": [{"role": "user"}]}).encode(),
        json.dumps({**CHAT, "stream_options": {"include_usage": "maybe"}}).encode(),
        json.dumps({**CHAT, "stop_token_ids": [-1]}).encode(),
    ],
)
def test_odd_bodies_never_500(http, raw):
    r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_every_response_has_an_x_request_id(http, backend):
    backend.script = text_chunks("Hi")
    answered = http.post("/v1/chat/completions", json=CHAT)
    assert answered.status_code == 200
    assert answered.headers["x-request-id"] == answered.json()["id"]  # it finds the trace
    streamed = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert streamed.headers["x-request-id"].startswith("chatcmpl-")
    refused = http.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert refused.status_code == 404 and len(refused.headers["x-request-id"]) == 32
    echoed = http.get("/v1/models", headers={"x-request-id": "mine-1"})
    assert echoed.headers["x-request-id"] == "mine-1"
