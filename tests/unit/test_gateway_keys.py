"""The gateway with API keys from SQL: OpenAI-shaped 401, and 429 per key per minute."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state, text_chunks

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.keylimits import MemoryMinuteLimits
from tokenyard.services.gateway.keys import KeyStore

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def store(tmp_path: Path) -> KeyStore:
    return KeyStore.open(f"sqlite:///{tmp_path / 'keys.db'}")


@pytest.fixture
def http(store: KeyStore):
    backend = FakeBackend()
    backend.script = text_chunks("ok")
    state = fake_state(backend)
    state.keys = store
    state.minute_limits = MemoryMinuteLimits(clock=lambda: 1000.0)  # 40 s into a minute
    with TestClient(create_app(state.settings, state), raise_server_exceptions=False) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    "headers", [{}, bearer("nope"), bearer("ty-00000000.secret"), {"Authorization": "Basic x"}]
)
def test_a_missing_or_unknown_key_is_401_in_openai_shape(http, headers):
    r = http.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert http.get("/v1/models", headers=headers).status_code == 401


def test_a_key_works_until_it_is_revoked(http, store):
    key, info = store.create("alice")
    assert http.post("/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200
    wrong_secret = key[: key.index(".") + 1] + "x" * 43
    assert (
        http.post("/v1/chat/completions", json=CHAT, headers=bearer(wrong_secret)).status_code
        == 401
    )
    assert store.revoke(info.prefix)
    assert http.post("/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 401


def test_requests_per_minute_are_limited_per_key(http, store):
    limited, _ = store.create("bob", requests_per_minute=2)
    other, _ = store.create("carol", requests_per_minute=2)
    codes = [
        http.post("/v1/chat/completions", json=CHAT, headers=bearer(limited)).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]
    r = http.post("/v1/chat/completions", json=CHAT, headers=bearer(limited))
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert r.headers["Retry-After"] == "20"  # the rest of the minute
    assert http.post("/v1/chat/completions", json=CHAT, headers=bearer(other)).status_code == 200


def test_tokens_per_minute_count_prompt_and_max_tokens(http, store):
    key, _ = store.create("dave", tokens_per_minute=100)
    # The fake tokenizer: one token per character of "<user>hi\n<assistant>" = 20, + 4.
    assert http.post("/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200
    big = {**CHAT, "max_tokens": 90}
    r = http.post("/v1/chat/completions", json=big, headers=bearer(key))
    assert r.status_code == 429
    assert "tokens per minute" in r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200
