"""What every FastAPI service shares: the one error type, the admin token check, and the
fault body the console forwards to the facilities service."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenyard.api_deps import Admin
from tokenyard.api_errors import ApiError, install_error_handler
from tokenyard.facilities.faults import FAULT_KINDS, FaultIn


class _Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_TEST_")
    admin_token: str | None = None


def _client(token: str | None, type_of=lambda status: f"kind-{status}") -> TestClient:
    app = FastAPI()
    app.state.settings = _Settings(admin_token=token)
    install_error_handler(app, type_of)
    router = APIRouter(dependencies=[Admin])

    @router.post("/act")
    async def act() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/busy")
    async def busy() -> None:
        raise ApiError(503, "try later", code="busy", retry_after_s=3)

    app.include_router(router)
    return TestClient(app)


def test_an_error_renders_with_the_apis_own_type_names_and_its_headers():
    resp = _client("t").get("/busy")
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "3"
    assert resp.json() == {
        "error": {"message": "try later", "type": "kind-503", "param": None, "code": "busy"}
    }
    error = ApiError(429, "slow down")
    assert error.type == "rate_limit_error"  # OpenAI's names by default
    assert error.sse().startswith('data: {"error": {"message": "slow down"')


@pytest.mark.parametrize(
    ("token", "headers", "status", "code"),
    [
        ("t", {}, 401, "missing_admin_token"),
        ("t", {"Authorization": "Bearer nope"}, 403, "invalid_admin_token"),
        (None, {"Authorization": "Bearer t"}, 403, "admin_disabled"),
        ("t", {"Authorization": "Bearer t"}, 200, None),
        ("t", {"X-Admin-Token": "t"}, 200, None),
    ],
)
def test_the_admin_token_is_asked_the_same_way_everywhere(token, headers, status, code):
    resp = _client(token).post("/act", headers=headers)
    assert resp.status_code == status, resp.text
    if code:
        assert resp.json()["error"]["code"] == code
    if status == 401:
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    if code == "admin_disabled":
        assert "TOKENYARD_TEST_ADMIN_TOKEN" in resp.json()["error"]["message"]


def test_a_fault_body_carries_what_the_facilities_service_reads():
    body = FaultIn.model_validate({"kind": "power_cap", "power_cap_kw": 3.0, "value": 9.0})
    assert body.model_dump(exclude_none=True) == {"kind": "power_cap", "power_cap_kw": 3.0}
    assert FAULT_KINDS == ("pump_failure", "chiller_failure", "power_cap", "dead_sensor")
    with pytest.raises(ValidationError):
        FaultIn.model_validate({"kind": "meteor"})
