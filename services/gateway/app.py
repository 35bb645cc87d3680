"""The FastAPI application: routers, error handlers, and start/stop in `lifespan`."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenyard.services.gateway.backend import NatsBackend
from tokenyard.services.gateway.bodylimit import LimitBody
from tokenyard.services.gateway.errors import install_error_handlers
from tokenyard.services.gateway.keylimits import make_minute_limits
from tokenyard.services.gateway.keys import KeyStore
from tokenyard.services.gateway.openapi import install_openapi
from tokenyard.services.gateway.ratelimit import make_limiter
from tokenyard.services.gateway.readiness import OptionalServices
from tokenyard.services.gateway.responses_api.store import ResponseStore
from tokenyard.services.gateway.routes import (
    chat,
    completions,
    embeddings,
    health,
    lora,
    models,
    responses,
    tokenize,
)
from tokenyard.services.gateway.serve import REQUEST_ID_SCOPE_KEY
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.gateway.state import GatewayState
from tokenyard.span_bus import spans_to_bus

log = logging.getLogger(__name__)


async def build_state(settings: GatewaySettings, stack: AsyncExitStack) -> GatewayState:
    from tokenyard.models.loader import load_tokenizer, model_id_of

    tokenizer = await asyncio.to_thread(load_tokenizer, settings.model_path)
    # The name the workers give the same model: the loader's rule, from metadata only.
    model_id = settings.model_id
    if not model_id:
        model_id = await asyncio.to_thread(model_id_of, settings.model_path or None)
    backend = NatsBackend(settings)
    await backend.start()
    stack.push_async_callback(backend.stop)
    assert backend.bus is not None
    await backend.fleet.racks.start(backend.bus)  # /ready: is every rack drained?
    await stack.enter_async_context(spans_to_bus(backend.bus, "gateway"))
    limiter = make_limiter(settings.rate_limit_rps, settings.rate_limit_burst, settings.redis_url)
    stack.push_async_callback(limiter.close)
    minute_limits = make_minute_limits(settings.redis_url)
    stack.push_async_callback(minute_limits.close)
    keys = None
    if settings.keys_db_url:
        keys = await asyncio.to_thread(KeyStore.open, settings.keys_db_url)
    stored = await asyncio.to_thread(
        ResponseStore.open, settings.responses_db_url, settings.responses_retention_s
    )
    stack.callback(stored.close)
    purging = asyncio.create_task(purge_expired(stored, settings.responses_purge_interval_s))
    stack.push_async_callback(_cancel, purging)
    return GatewayState(
        settings=settings,
        backend=backend,
        tokenizer=tokenizer,
        limiter=limiter,
        model_id=model_id,
        keys=keys,
        minute_limits=minute_limits,
        optional_services=OptionalServices(settings.optional_services),
        responses=stored,
    )


async def purge_expired(store: ResponseStore, interval_s: float) -> None:
    """Delete expired responses every `interval_s` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            gone = await asyncio.to_thread(store.purge)
        except Exception:  # the database may be away for a while: try again next time
            log.exception("could not delete expired responses")
            continue
        if gone:
            log.info("deleted %d expired responses", gone)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class CountRequests:
    """Counts answers by route and status. Plain ASGI on purpose.

    NOTE: not @app.middleware("http"): that wraps `receive`, and a handler then no longer
    sees its client disconnect (request.is_disconnected()), so nothing would be cancelled.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            state = getattr(scope["app"].state, "gateway", None) if "app" in scope else None
            if state is not None:
                path = getattr(scope.get("route"), "path", "unmatched")
                state.metrics.requests.labels(path, str(status[0])).inc()


class RequestIdHeader:
    """`x-request-id` on every response: a generating route's request id (the one that finds
    its trace in the telemetry service), else the caller's own, else a fresh one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = scope.get(REQUEST_ID_SCOPE_KEY) or Headers(scope=scope).get("x-request-id")
                MutableHeaders(scope=message)["x-request-id"] = rid or uuid.uuid4().hex
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(settings: GatewaySettings, state: GatewayState | None = None) -> FastAPI:
    """The gateway app; `state` replaces NATS, tokenizer and limiter (tests pass fakes)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            app.state.gateway = state or await build_state(settings, stack)
            log.info(
                "gateway %s serving %s on %s:%d",
                settings.instance_id,
                app.state.gateway.model_id,
                settings.host,
                settings.port,
            )
            yield

    app = FastAPI(
        title="Tokenyard gateway",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible REST API of a Tokenyard cluster",
    )
    app.state.settings = settings  # the admin token (tokenyard.api_deps.require_admin)
    for module in (chat, completions, responses, embeddings, models, tokenize, health, lora):
        app.include_router(module.router)
    install_error_handlers(app)
    install_openapi(app)

    app.add_middleware(LimitBody, max_bytes=settings.max_body_bytes)
    app.add_middleware(CountRequests)
    app.add_middleware(RequestIdHeader)
    return app
