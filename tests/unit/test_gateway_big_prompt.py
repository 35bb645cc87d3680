"""A big prompt never holds up the event loop: one too long to fit is refused before it is
tokenized, and one that may fit is tokenized off the loop while other requests are served."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, CharTokenizer, FakeBackend, fake_state

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.translate import MAX_BYTES_PER_TOKEN

MAX_MODEL_LEN = 256  # fake_state's
TOO_MANY_BYTES = MAX_MODEL_LEN * MAX_BYTES_PER_TOKEN + 1


class NoTokenizing(CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized a prompt that cannot fit")


class GatedTokenizer(CharTokenizer):
    """Tokenizes only once the test lets it: `released` says whether it was let in time."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.released: bool | None = None

    def encode_chat(self, messages: list[dict], **variables: object) -> list[int]:
        self.started.set()
        self.released = self.release.wait(timeout=10)
        return super().encode_chat(messages, **variables)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def http(backend):
    state = fake_state(backend)
    state.tokenizer = NoTokenizing()
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as client:
        yield client


def chat(content: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat("x" * TOO_MANY_BYTES), "messages"),
        # Bytes, not characters: two bytes each in UTF-8.
        ("/v1/chat/completions", chat("é" * (TOO_MANY_BYTES // 2 + 1)), "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * TOO_MANY_BYTES}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["x" * TOO_MANY_BYTES]}, "prompt"),
    ],
)
def test_a_prompt_too_long_to_fit_is_refused_without_tokenizing(http, backend, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert backend.submitted == []


def test_a_prompt_that_may_fit_is_tokenized_and_counted(backend):
    state = fake_state(backend)
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as http:
        r = http.post("/v1/chat/completions", json=chat("x" * (TOO_MANY_BYTES - 1)))
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens (leave room" in r.json()["error"]["message"]  # the tokenizer's count


async def test_other_requests_are_served_while_a_prompt_is_tokenized(backend):
    state = fake_state(backend, max_model_len=100_000)
    tokenizer = GatedTokenizer()
    state.tokenizer = tokenizer
    app = create_app(state.settings, state)
    app.state.gateway = state  # what the lifespan would do
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        body = {**chat("x" * 50_000), "max_tokens": 4}
        big = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        assert await asyncio.to_thread(tokenizer.started.wait, 10)
        # Were the prompt tokenized on the loop, nothing else would run until it was done.
        health = await client.get("/health")
        tokenizer.release.set()
        answer = await big
    assert health.status_code == 200
    assert answer.status_code == 200, answer.text
    assert tokenizer.released  # /health answered while the tokenizer was still held
