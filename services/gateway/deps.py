"""FastAPI dependencies as `Annotated` aliases: the gateway state, and admission (key + rate limit)."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tokenyard.api_errors import ApiError
from tokenyard.services.gateway.keys import KeyInfo
from tokenyard.services.gateway.ratelimit import retry_after
from tokenyard.services.gateway.state import GatewayState
from tokenyard.services.gateway.translate import Prepared


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


State = Annotated[GatewayState, Depends(get_state)]
_bearer = HTTPBearer(auto_error=False, description="An API key, when the gateway has any")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


@dataclass(frozen=True)
class Identity:
    """Who is asking: `name` keys the rate limits; `key` is set for a key from SQL.

    `tenant` is the cache namespace the caller is always inside: "key:<tenant>" for a key
    from SQL, "static:<sha256 of the key>" for a static key (each its own), None on an open
    gateway. The prefixes keep the two kinds apart whatever a tenant is named. The workers'
    fair queue shares tokens between these tenants too (`share_as`).
    """

    name: str
    key: KeyInfo | None = None
    tenant: str | None = None

    @property
    def share_as(self) -> str:
        """The tenant the workers' fair queue charges: the key's tenant name, a static
        key's hash (shortened: a metrics label), one shared tenant on an open gateway."""
        if self.key is not None:
            return self.key.tenant
        return (self.tenant or "")[: len("static:") + 12]

    def default_priority(self, tiers: dict[str, int]) -> int:
        """The key's tier (gateway setting priority_tiers): by its prefix, then its tenant."""
        if self.key is None:
            return 0
        return tiers.get(self.key.prefix, tiers.get(self.key.tenant, 0))


def authenticate(state: State, credentials: Credentials, request: Request) -> Identity:
    """The caller's identity: its key, or its address on an open gateway.

    NOTE: a plain def: FastAPI runs it in a thread, so a key store lookup never blocks the loop.
    """
    static, store = state.settings.api_keys, state.keys
    if not static and store is None:
        return Identity(f"ip:{request.client.host if request.client else 'unknown'}")
    given = credentials.credentials if credentials else ""
    if any(secrets.compare_digest(given, key) for key in static):
        return Identity(
            f"key:{given}", tenant=f"static:{hashlib.sha256(given.encode()).hexdigest()}"
        )
    info = store.verify(given) if store is not None and given else None
    if info is None:
        raise ApiError(
            401,
            "Incorrect API key provided. Pass a valid key as 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )
    return Identity(f"key:{info.prefix}", info, tenant=f"key:{info.tenant}")


def too_many(message: str, wait_s: float) -> ApiError:
    return ApiError(429, message, code="rate_limit_exceeded", retry_after_s=retry_after(wait_s))


async def admit(state: State, caller: Annotated[Identity, Depends(authenticate)]) -> Identity:
    wait = await state.limiter.take(caller.name)
    if wait is not None:
        raise too_many("rate limit reached for this API key; retry later", wait)
    rpm = caller.key.requests_per_minute if caller.key else None
    if rpm is not None:
        wait = await state.minute_limits.take(f"rpm:{caller.name}", rpm, 1)
        if wait is not None:
            raise too_many(f"Rate limit reached for requests per minute (limit {rpm}).", wait)
    return caller


def cache_salt(caller: Identity, requested: str | None) -> str:
    """The salt a request's prefix hashes start from: the caller's tenant, then whatever the
    request adds. Written as a JSON pair, one string per (tenant, salt): no request can spell
    another tenant's salt, and no two pairs meet (as "a|b" + "c" and "a" + "b|c" did)."""
    if caller.tenant is None and not requested:
        return ""  # an open gateway's shared namespace, as the workers' default
    return json.dumps([caller.tenant or "", requested or ""])


async def admit_prepared(state: GatewayState, caller: Identity, prepared: Prepared) -> None:
    """What depends on who asks, once the prompt is known: the cache salt, the priority and
    fair-share tenant, and tokens per minute, charged up front: the prompts (each computed
    once) plus what every sequence may generate (`n` choices, or `best_of` when more are
    generated than returned)."""
    prepared.params.cache_salt = cache_salt(caller, prepared.cache_salt)
    prepared.params.tenant = caller.share_as
    prepared.params.priority = (
        caller.default_priority(state.settings.priority_tiers)
        if prepared.priority is None
        else prepared.priority
    )
    sequences = len(prepared.prompts) * prepared.best_of
    cost = prepared.num_prompt_tokens + sequences * prepared.params.max_tokens
    await charge_tokens(state, caller, cost)


async def charge_tokens(state: GatewayState, caller: Identity, cost: int) -> None:
    """Take `cost` tokens from the caller's tokens-per-minute limit, if its key has one."""
    tpm = caller.key.tokens_per_minute if caller.key else None
    if tpm is None:
        return
    wait = await state.minute_limits.take(f"tpm:{caller.name}", tpm, cost)
    if wait is not None:
        raise too_many(
            f"Rate limit reached for tokens per minute (limit {tpm}, requested {cost}); "
            "lower max_tokens or retry later.",
            wait,
        )


Caller = Annotated[Identity, Depends(admit)]
Authenticated = Annotated[Identity, Depends(authenticate)]
