"""/v1/embeddings over ASGI with a scripted backend: the official client, shapes, errors."""

from __future__ import annotations

import base64
import math
import struct

import openai
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import BOS, MODEL, FakeBackend, fake_state

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.embeddings import shortened
from tokenyard.v1 import serving_pb2 as pb

VECTOR = [0.6, 0.0, 0.8, 0.0]  # a unit vector, as the workers send it


@pytest.fixture
def backend() -> FakeBackend:
    done = pb.TokenChunk(index=0, finished=True, finish_reason="stop", embedding=VECTOR)
    return FakeBackend(script=[done])


@pytest.fixture
def http(backend):
    state = fake_state(backend)
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as client:
        yield client


@pytest.fixture
def oai(http) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
    )


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True))


def test_sdk_batch_of_strings(oai, backend):
    out = oai.embeddings.create(model=MODEL, input=["a", "bc"])  # the SDK asks for base64
    assert [d.index for d in out.data] == [0, 1]
    assert all(close(d.embedding, VECTOR) for d in out.data)
    assert out.usage.prompt_tokens == out.usage.total_tokens == 2 + 3  # BOS + characters
    assert [s[2] for s in backend.submitted] == [[BOS, ord("a") + 10], [BOS, 108, 109]]
    params = backend.submitted[0][3]
    assert params.pooling == "last" and params.max_tokens == 1  # the gateway's default
    assert len({s[0] for s in backend.submitted}) == 2  # a request id each


def test_float_format_token_ids_and_pooling_choice(http, backend):
    r = http.post(
        "/v1/embeddings",
        json={
            "model": MODEL,
            "input": [[11, 12], [13]],
            "encoding_format": "float",
            "pooling": "mean",
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert all(close(d["embedding"], VECTOR) for d in body["data"]) and len(body["data"]) == 2
    assert body["data"][0]["object"] == "embedding"
    assert [s[2] for s in backend.submitted] == [[11, 12], [13]]
    assert backend.submitted[0][3].pooling == "mean"
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": [11, 12, 13]})
    assert r.status_code == 200 and len(r.json()["data"]) == 1


def test_dimensions_shorten_and_renormalize(oai):
    out = oai.embeddings.create(model=MODEL, input="a", dimensions=2, encoding_format="float")
    assert close(out.data[0].embedding, [1.0, 0.0])
    assert close(shortened([3.0, 4.0, 5.0], 2), [0.6, 0.8])


def test_base64_is_little_endian_float32(http):
    r = http.post(
        "/v1/embeddings", json={"model": MODEL, "input": "a", "encoding_format": "base64"}
    )
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert close(list(struct.unpack("<4f", raw)), VECTOR)
    assert math.isclose(sum(x * x for x in struct.unpack("<4f", raw)), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[11], []]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x" * 300}, "input"),  # longer than max_model_len (256)
        ({"input": "a", "dimensions": 5}, "dimensions"),  # larger than the vector
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "pooling": "max"}, "pooling"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_404(http):
    r = http.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    assert r.status_code == 404


def test_a_worker_refusal_cancels_the_other_inputs(http, backend):
    backend.script = [
        pb.TokenChunk(
            index=0,
            finished=True,
            finish_reason="error",
            error=pb.Error(code=pb.Error.INVALID_REQUEST, message="bad prompt"),
        )
    ]
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]})
    assert r.status_code == 400 and "bad prompt" in r.json()["error"]["message"]
    assert all(s.closed for s in backend.streams)
