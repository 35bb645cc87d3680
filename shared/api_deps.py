"""What every Tokenyard FastAPI service's admin actions ask first: the admin token.

    router = APIRouter(prefix="/v1/admin", dependencies=[Admin])

The app keeps its settings in ``app.state.settings``; their ``admin_token`` (empty: admin
actions are disabled) is the one accepted. A caller presents it as
``Authorization: Bearer <token>`` or ``X-Admin-Token: <token>``. The gRPC control API
(facilities) asks the same `check_admin`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Header, Request
from pydantic_settings import BaseSettings

from tokenyard.api_errors import ApiError

REFUSAL_CODES = {
    "missing": "missing_admin_token",
    "wrong": "invalid_admin_token",
    "disabled": "admin_disabled",
}


@dataclass
class AdminRefusal(Exception):
    kind: Literal["missing", "wrong", "disabled"]
    message: str


def check_admin(expected: str | None, given: str | None, setting: str = "an admin token") -> None:
    """Raise AdminRefusal unless `given` is the configured admin token (`setting` names where
    it is configured, for the refusal while there is none)."""
    if not expected:
        raise AdminRefusal("disabled", f"the admin API is disabled: set {setting}")
    if not given:
        raise AdminRefusal("missing", "missing admin token (Authorization: Bearer <token>)")
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise AdminRefusal("wrong", "invalid admin token")


def admin_setting(settings: BaseSettings) -> str:
    """The environment variable that configures a service's admin token."""
    return f"{settings.model_config.get('env_prefix', '')}ADMIN_TOKEN"


def require_admin(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_admin_token: Annotated[str | None, Header()] = None,
) -> None:
    """401 when no token is presented, 403 when it is wrong or admin actions are disabled."""
    settings = request.app.state.settings
    given = x_admin_token
    if authorization and authorization.lower().startswith("bearer "):
        given = authorization[7:].strip()
    try:
        check_admin(settings.admin_token, given, admin_setting(settings))
    except AdminRefusal as refusal:
        if refusal.kind == "missing":
            raise ApiError(
                401,
                refusal.message,
                code=REFUSAL_CODES[refusal.kind],
                headers={"WWW-Authenticate": "Bearer"},
            ) from refusal
        raise ApiError(403, refusal.message, code=REFUSAL_CODES[refusal.kind]) from refusal


Admin = Depends(require_admin)
