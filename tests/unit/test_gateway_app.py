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
from tokenyard.services.gateway.ratelimit import MemoryBuckets, NoLimit
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import RackState, RackStateKind

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


def beat(backend: FakeBackend, worker_id: str, role: str, **fields: object) -> None:
    hb = pb.WorkerHeartbeat(worker_id=worker_id, role=role, model=MODEL, **fields)
    backend.fleet.on_heartbeat(hb, time.monotonic())


def test_ready_reports_workers(backend, http):
    r = http.get("/ready")
    assert r.status_code == 503
    assert r.json()["reason"] == "no worker can take a request: no live prefill worker"
    beat(backend, "d1", "decode")
    assert http.get("/ready").status_code == 503  # a decode worker that prefills nothing
    beat(backend, "p1", "prefill")
    body = http.get("/ready").json()
    assert body["ready"] and body["roles"] == {"prefill": 1, "decode": 1}
    assert {w["worker_id"] for w in body["workers"]} == {"p1", "d1"}


def test_ready_follows_the_router_a_prefill_worker_decodes_its_own(backend, http):
    beat(backend, "p1", "prefill")  # the router places it aggregated: "no live decode worker"
    assert http.get("/ready").status_code == 200


def test_ready_while_decode_workers_run_whole_requests():
    """The prefill worker is restarting: a decode worker that announces local prefill runs
    whole requests, so chats succeed and /ready must say so; under "always" it may not."""
    backend = FakeBackend()
    beat(backend, "d1", "decode", local_prefill=True)
    with make_client(fake_state(backend)) as http:
        assert http.get("/ready").status_code == 200
    with make_client(fake_state(backend, router_disaggregation="always")) as http:
        r = http.get("/ready")
        assert r.status_code == 503 and "no live prefill worker" in r.json()["reason"]


def test_ready_counts_only_workers_that_say_they_can_take_work(backend, http):
    missing = "its JetStream consumer prefill-p1 is missing"
    beat(backend, "p1", "prefill", not_ready=missing)
    beat(backend, "d1", "decode")
    r = http.get("/ready")
    assert r.status_code == 503
    assert r.json()["reason"] == (
        f"no worker can take a request: no live prefill worker (p1: {missing})"
    )
    beat(backend, "p1", "prefill")
    assert http.get("/ready").status_code == 200


def rack_state(rack: str, state: int, workers: list[str], reason: str = "") -> RackState:
    return RackState(
        rack=rack,
        state=state,
        reason=reason,
        worker_ids=workers,
        sent_unix_s=time.time(),
        heartbeat_s=5,
    )


def test_ready_says_why_while_every_rack_is_drained(backend, http):
    beat(backend, "b1", "both")
    beat(backend, "b2", "both")
    racks = backend.fleet.racks
    racks.apply(rack_state("rack-a", RackStateKind.RACK_STATE_DRAIN, ["b1"], "pump failure"))
    assert http.get("/ready").status_code == 200  # b2's rack still takes work
    racks.apply(rack_state("rack-b", RackStateKind.RACK_STATE_DRAIN, ["b2"], "supply too warm"))
    r = http.get("/ready")
    assert r.status_code == 503
    assert r.json()["reason"] == (
        "no worker can take a request: every prefill worker's rack is drained "
        "(rack rack-a drained: pump failure; rack rack-b drained: supply too warm)"
    )
    racks.apply(rack_state("rack-a", RackStateKind.RACK_STATE_NORMAL, ["b1"]))
    assert http.get("/ready").status_code == 200


def test_a_busy_fleet_is_still_ready(backend, http):
    beat(backend, "b1", "both", max_num_seqs=1, num_running=1, num_waiting=500)
    assert http.get("/ready").status_code == 200


class DownStore(NoLimit):
    async def problem(self) -> str | None:
        return "the rate limit store (Redis) does not answer (ConnectionError)"


def test_ready_is_false_while_the_limit_store_is_down(backend):
    beat(backend, "b1", "both")
    with make_client(fake_state(backend, limiter=DownStore())) as http:
        r = http.get("/ready")
    assert r.status_code == 503
    assert r.json()["reason"] == "the rate limit store (Redis) does not answer (ConnectionError)"


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


def test_optional_services_from_environment(monkeypatch):
    value = "kvcache=http://127.0.0.1:1/health, telemetry=http://127.0.0.1:2/health"
    monkeypatch.setenv("TOKENYARD_GATEWAY_OPTIONAL_SERVICES", value)
    assert GatewaySettings().optional_services == {
        "kvcache": "http://127.0.0.1:1/health",
        "telemetry": "http://127.0.0.1:2/health",
    }
    monkeypatch.setenv("TOKENYARD_GATEWAY_OPTIONAL_SERVICES", "kvcache")
    with pytest.raises(ValueError, match="name=url"):
        GatewaySettings()


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


def test_completions_with_a_batch_of_prompts(oai, backend):
    backend.script = text_chunks("ok")
    out = oai.completions.create(model=MODEL, prompt=["ab", "xyz"], n=2, max_tokens=4)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == ["ok"] * 4
    # prompt i's sequences get prompt i; each prompt's first is routed, its others follow it
    prompts = [s[2] for s in backend.submitted]
    assert prompts == [[1, 107, 108]] * 2 + [[1, 130, 131, 132]] * 2
    assert [p is None for p in backend.placements] == [True, False, True, False]
    # each prompt counts once (5 tokens as the workers report), every choice's output adds up
    assert out.usage.prompt_tokens == 10 and out.usage.completion_tokens == 8


def test_completions_with_a_batch_of_prompts_streamed(oai, backend):
    backend.script = text_chunks("okay")
    stream = oai.completions.create(
        model=MODEL,
        prompt=[[11, 12], [13]],
        n=2,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finished, usage = set(), None
    for event in stream:
        usage = event.usage or usage
        for choice in event.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {i: "okay" for i in range(4)} and finished == {0, 1, 2, 3}
    assert usage.prompt_tokens == 10 and usage.completion_tokens == 16


def test_completions_batch_with_echo_and_best_of(oai, backend):
    backend.script = text_chunks("!", logprobs=True)
    out = oai.completions.create(
        model=MODEL, prompt=["a", "b"], n=1, best_of=2, echo=True, max_tokens=1
    )
    assert [(c.index, c.text) for c in out.choices] == [(0, "a!"), (1, "b!")]
    assert len(backend.submitted) == 4
