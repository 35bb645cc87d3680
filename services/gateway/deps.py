"""FastAPI dependencies as `Annotated` aliases: the gateway state, and admission (key + rate limit)."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tokenyard.services.gateway.errors import OpenAIError
from tokenyard.services.gateway.ratelimit import retry_after
from tokenyard.services.gateway.state import GatewayState


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


State = Annotated[GatewayState, Depends(get_state)]
_bearer = HTTPBearer(auto_error=False, description="An API key, when the gateway has any")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def authenticate(state: State, credentials: Credentials, request: Request) -> str:
    """The caller's identity for rate limiting: its key, or its address on an open gateway."""
    keys = state.settings.api_keys
    if not keys:
        return f"ip:{request.client.host if request.client else 'unknown'}"
    given = credentials.credentials if credentials else ""
    if not any(secrets.compare_digest(given, key) for key in keys):
        raise OpenAIError(
            401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key"
        )
    return f"key:{given}"


async def admit(state: State, caller: Annotated[str, Depends(authenticate)]) -> str:
    wait = await state.limiter.take(caller)
    if wait is not None:
        raise OpenAIError(
            429,
            "rate limit reached for this API key; retry later",
            code="rate_limit_exceeded",
            retry_after_s=retry_after(wait),
        )
    return caller


Caller = Annotated[str, Depends(admit)]
Authenticated = Annotated[str, Depends(authenticate)]
