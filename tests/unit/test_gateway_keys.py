"""The gateway with API keys from SQL: OpenAI-shaped 401, and 429 per key per minute."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state, text_chunks

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.deps import Identity, cache_salt
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


def test_a_keys_tenant_salts_its_prefixes_whatever_the_request_says(http, store):
    key, _ = store.create("erin", tenant="acme")
    backend = http.app.state.gateway.backend
    http.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
    forged = {**CHAT, "cache_salt": "tenant:other"}
    http.post("/v1/chat/completions", json=forged, headers=bearer(key))
    salts = [params.cache_salt for _, _, _, params in backend.submitted]
    assert salts == ['["key:acme", ""]', '["key:acme", "tenant:other"]']


def test_tokens_per_minute_charge_every_choice(http, store):
    key, _ = store.create("fay", tokens_per_minute=100)
    # 20 prompt tokens + 3 choices x 4 = 32; then 20 + 32 x 4 = 148 is over the limit alone.
    assert (
        http.post("/v1/chat/completions", json={**CHAT, "n": 3}, headers=bearer(key)).status_code
        == 200
    )
    r = http.post("/v1/chat/completions", json={**CHAT, "n": 32}, headers=bearer(key))
    assert r.status_code == 429
    assert "requested 148" in r.json()["error"]["message"]


def test_tokens_per_minute_charge_best_of_not_n(http, store):
    key, _ = store.create("gus", tokens_per_minute=100)
    prompt = {"model": MODEL, "prompt": "x" * 19, "max_tokens": 10}  # BOS + 19 = 20 tokens
    fits = {**prompt, "n": 1, "best_of": 8}  # 20 + 8 x 10 = 100
    assert http.post("/v1/completions", json=fits, headers=bearer(key)).status_code == 200
    other, _ = store.create("hal", tokens_per_minute=100)
    over = {**prompt, "n": 1, "best_of": 9}  # 20 + 9 x 10 = 110
    r = http.post("/v1/completions", json=over, headers=bearer(other))
    assert r.status_code == 429
    assert "requested 110" in r.json()["error"]["message"]


def static_key_client(keys: list[str]) -> TestClient:
    backend = FakeBackend()
    backend.script = text_chunks("ok")
    state = fake_state(backend, api_keys=keys)
    return TestClient(create_app(state.settings, state), raise_server_exceptions=False)


def test_a_static_key_is_its_own_tenant_and_cannot_name_another():
    with static_key_client(["sk-one", "sk-two"]) as http:
        for key, salt in [("sk-one", None), ("sk-two", None), ("sk-one", "tenant:alice")]:
            body = CHAT if salt is None else {**CHAT, "cache_salt": salt}
            assert (
                http.post("/v1/chat/completions", json=body, headers=bearer(key)).status_code == 200
            )
        salts = [p.cache_salt for *_, p in http.app.state.gateway.backend.submitted]
    one, two, forged = salts
    assert len({one, two, forged, ""}) == 4  # each key its own namespace, never the shared one
    assert "sk-one" not in one  # the key itself never travels to the workers
    assert forged != cache_salt(Identity("key:x", tenant="key:alice"), None)
    assert forged != "tenant:alice"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # A tenant and a salt that spell the same text when joined.
        ((Identity("x", tenant="key:a|b"), "c"), (Identity("x", tenant="key:a"), "b|c")),
        # An SQL tenant named like a static key's.
        ((Identity("x", tenant="key:static:ab"), None), (Identity("x", tenant="static:ab"), None)),
        # A request on an open gateway that names a tenant's salt.
        ((Identity("x"), '["key:acme", ""]'), (Identity("x", tenant="key:acme"), None)),
        ((Identity("x"), "key:acme"), (Identity("x", tenant="key:acme"), None)),
    ],
)
def test_tenant_salts_never_collide(a, b):
    assert cache_salt(*a) != cache_salt(*b)


def test_an_open_gateway_without_a_salt_keeps_the_shared_namespace():
    assert cache_salt(Identity("ip:1.2.3.4"), None) == ""
