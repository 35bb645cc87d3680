"""Bad input never reaches the engine: bounds the protobuf carries, valid Unicode, bounded
lists, tool messages name their call, and a body over the limit is refused before it is read."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.bodylimit import LimitBody

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
HEADERS = {"content-type": "application/json"}


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def http(backend):
    state = fake_state(backend)
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "top_k": 2**31}, "top_k"),
        ({**CHAT, "stop_token_ids": [2**32]}, "stop_token_ids.0"),
        ({**CHAT, "stop_token_ids": list(range(1000))}, "stop_token_ids"),
        ({**CHAT, "max_tokens": 2**32}, "max_tokens"),
        ({**CHAT, "stop": ["x" * 5000]}, "stop"),
        ({**CHAT, "messages": [{"role": "tool", "content": "42"}]}, "messages.0"),
        ({**CHAT, "messages": [{"role": "user", "content": "hi"}] * 3000}, "messages"),
        ({**CHAT, "tools": [{"type": "function"}] * 500}, "tools"),
    ],
)
def test_out_of_range_fields_are_400_naming_the_field(http, backend, body, param):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert backend.submitted == []


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
        b'{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800"}',
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}',
        b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "response_format": {"\\ud800": 1}}',
    ],
)
def test_lone_surrogates_are_400_not_500(http, backend, raw):
    r = http.post(
        "/v1/chat/completions", content=raw.replace(b"%s", MODEL.encode()), headers=HEADERS
    )
    assert r.status_code == 400, r.text
    # A union (str | list of parts) reports its first branch's error first; the rest name it.
    assert r.json()["error"]["code"] == "invalid_value"
    assert backend.submitted == []


def test_a_lone_surrogate_error_says_why(http):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}'
    r = http.post("/v1/chat/completions", content=raw % MODEL.encode(), headers=HEADERS)
    assert "unicode" in r.json()["error"]["message"].lower()


def test_lone_surrogate_in_a_completion_prompt_is_400(http):
    raw = b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode()
    assert http.post("/v1/completions", content=raw, headers=HEADERS).status_code == 400


def test_a_tool_message_with_its_call_id_is_accepted(http, backend):
    messages = [
        {"role": "user", "content": "x"},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(http, backend):
    limit = fake_state(backend).settings.max_body_bytes
    r = http.post(
        "/v1/chat/completions",
        content=b"x" * 10,
        headers={**HEADERS, "content-length": str(limit + 1)},
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


async def test_a_chunked_body_is_cut_off_at_the_limit():
    """No Content-Length: the middleware counts and stops reading at the first byte over."""
    chunks = [b"a" * 600, b"b" * 600, b"c" * 600]
    reads: list[int] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        raise AssertionError("the whole body was read")

    async def receive():
        reads.append(1)
        body = chunks[len(reads) - 1]
        return {"type": "http.request", "body": body, "more_body": len(reads) < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": [], "method": "POST", "path": "/"}
    await LimitBody(app, max_bytes=1024)(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert len(reads) == 2  # the third chunk was never asked for
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_413_through_the_app(http, backend):
    """No Content-Length: FastAPI's own body parsing must not turn the cut-off into a 400."""
    limit = fake_state(backend).settings.max_body_bytes

    def chunks():
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    r = http.post("/v1/chat/completions", content=chunks(), headers=HEADERS)
    assert r.status_code == 413, r.text
    assert r.json()["error"] == {
        "message": f"the request body is larger than {limit} bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    assert backend.submitted == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**70),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("n", 0),
        ("n", 129),
        ("max_tokens", 0),
        ("max_completion_tokens", 2**32),
        ("top_k", -2),
        ("top_logprobs", 21),
        ("min_tokens", -1),
        ("min_tokens", 2**32),
    ],
)
def test_integer_fields_out_of_vllms_bounds_are_400_naming_the_field(http, backend, field, value):
    r = http.post("/v1/chat/completions", json={**CHAT, field: value, "logprobs": True})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert backend.submitted == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("best_of", 0), ("best_of", 129), ("logprobs", 21), ("logprobs", -1), ("seed", 2**70)],
)
def test_completion_integer_fields_out_of_bounds_are_400(http, backend, field, value):
    body = {"model": CHAT["model"], "prompt": "hi", field: value}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert backend.submitted == []


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_seeds_at_the_int64_bounds_are_taken(http, backend, seed):
    r = http.post("/v1/chat/completions", json={**CHAT, "seed": seed, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert backend.submitted[0][3].seed == seed % 2**64
