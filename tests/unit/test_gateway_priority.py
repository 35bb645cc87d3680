"""A request's `priority` (vLLM's field), a key's default tier, and the fair-share tenant the
gateway puts on each request for the workers' queue."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from gateway_fakes import MODEL, FakeBackend, fake_state, text_chunks
from pydantic import ValidationError

from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.keys import KeyStore
from tokenyard.services.gateway.settings import GatewaySettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def client(store: KeyStore | None = None, **settings: object) -> TestClient:
    backend = FakeBackend()
    backend.script = text_chunks("ok")
    state = fake_state(backend, **settings)
    state.keys = store
    return TestClient(create_app(state.settings, state), raise_server_exceptions=False)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def submitted(http: TestClient) -> list:
    return [params for *_, params in http.app.state.gateway.backend.submitted]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("priority", [101, -101, 2**40])
def test_a_priority_out_of_range_is_400_naming_it(path, priority):
    body = {**(CHAT if "chat" in path else COMPLETION), "priority": priority}
    with client() as http:
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "priority" and error["type"] == "invalid_request_error"
        assert submitted(http) == []


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_requests_priority_reaches_the_workers(path):
    body = {**(CHAT if "chat" in path else COMPLETION), "priority": -7}
    with client() as http:
        assert http.post(path, json=body).status_code == 200
        assert [p.priority for p in submitted(http)] == [-7]
        assert [p.tenant for p in submitted(http)] == [""]  # an open gateway: one tenant


def test_a_keys_tier_is_the_default_and_the_request_overrides_it(tmp_path: Path):
    store = KeyStore.open(f"sqlite:///{tmp_path / 'keys.db'}")
    batch, _ = store.create("nightly", tenant="batch")
    vip, vip_info = store.create("vip", tenant="acme")
    plain, _ = store.create("plain", tenant="acme")
    tiers = {"batch": 10, vip_info.prefix: -5}
    with client(store, priority_tiers=tiers) as http:
        for key, body in [
            (batch, CHAT),
            (vip, CHAT),
            (plain, CHAT),  # acme has no tier of its own: 0
            (batch, {**CHAT, "priority": 3}),
        ]:
            assert http.post("/v1/chat/completions", json=body, headers=bearer(key)).is_success
        params = submitted(http)
    assert [p.priority for p in params] == [10, -5, 0, 3]
    assert [p.tenant for p in params] == ["batch", "acme", "acme", "batch"]


def test_static_keys_are_tenants_of_their_own():
    with client(api_keys=["sk-one", "sk-two"]) as http:
        for key in ("sk-one", "sk-two"):
            assert http.post("/v1/chat/completions", json=CHAT, headers=bearer(key)).is_success
        one, two = (p.tenant for p in submitted(http))
    assert one != two and one.startswith("static:") and "sk-" not in one + two


def test_priority_tiers_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENYARD_GATEWAY_PRIORITY_TIERS", "batch=10, ty-ab12=-5")
    assert GatewaySettings().priority_tiers == {"batch": 10, "ty-ab12": -5}
    monkeypatch.setenv("TOKENYARD_GATEWAY_PRIORITY_TIERS", "batch=1000")
    with pytest.raises(ValidationError, match="must be in"):
        GatewaySettings()
