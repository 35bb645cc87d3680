"""The ops HTTP server every service runs beside its main work.

    async with ops_server(settings.ops_host, settings.ops_port, ready=worker.not_ready) as ops:
        log.info("ops on %s", ops.url)          # GET /health, /ready, /metrics
        await stop.wait()

- ``GET /health``: 200 while the process lives (the event loop answers).
- ``GET /ready``: 200 when ``ready()`` returns (or its awaitable resolves to) None, else 503
  with the reason it returned; an async check may ask the service's dependencies live.
- ``GET /metrics``: the Prometheus registry (the process-wide one by default), text format.

Port 0 binds any free port (tests); ``ops.port`` then says which. Services that already
serve HTTP (gateway, facilities, telemetry) mount ``ops_router`` into their own app instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

SHUTDOWN_GRACE_S = 3  # seconds
# The reason the service cannot take work now, or None when it can (or an awaitable of that).
Readiness = Callable[[], str | None | Awaitable[str | None]]


def always_ready() -> str | None:
    return None


class ReadyFlag:
    """A readiness callable a service sets as it starts and stops.

    flag = ReadyFlag("loading the model"); ...; flag.set(None)  # ready; flag.set("stopping")
    """

    def __init__(self, reason: str | None = "starting") -> None:
        self.reason = reason

    def set(self, reason: str | None) -> None:
        self.reason = reason

    def __call__(self) -> str | None:
        return self.reason


def ops_router(
    ready: Readiness = always_ready,
    registry: CollectorRegistry = REGISTRY,
    *,
    health: bool = True,
) -> APIRouter:
    """/health, /ready and /metrics as a router, for services with an app of their own
    (health=False where the app already answers /health itself)."""
    router = APIRouter(tags=["operations"])

    if health:

        @router.get("/health")
        async def alive() -> dict[str, str]:
            return {"status": "ok"}

    @router.get("/ready", responses={503: {"description": "Not ready, with the reason"}})
    async def readiness() -> JSONResponse:
        answer = ready()
        reason = await answer if inspect.isawaitable(answer) else answer
        body = {"ready": reason is None, "reason": reason}
        return JSONResponse(body, status_code=200 if reason is None else 503)

    @router.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


class QuietServer(uvicorn.Server):
    # NOTE: the service owns the signals (one stop event for all its parts); uvicorn's own
    # handlers would swallow SIGINT/SIGTERM.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """Bind before serving, so port 0 (tests) resolves to a real port the caller can read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class Served:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.asynccontextmanager
async def serve_app(app: FastAPI, host: str, port: int) -> AsyncIterator[Served]:
    """Serve `app` on host:port while the block runs; stops (and closes the socket) after."""
    sock = bind(host, port)
    # NOTE: a bounded graceful stop: open event streams (the console's) never end by themselves.
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
    )
    server = QuietServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"http:{host}:{port}")
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            task.result()  # raises what stopped it
        bound_host, bound_port = sock.getsockname()[:2]
        yield Served(bound_host, bound_port)
    finally:
        server.should_exit = True
        await task
        sock.close()


@contextlib.asynccontextmanager
async def ops_server(
    host: str,
    port: int,
    *,
    ready: Readiness = always_ready,
    registry: CollectorRegistry = REGISTRY,
) -> AsyncIterator[Served]:
    """/health, /ready and /metrics on host:port while the block runs."""
    app = FastAPI(title="Tokenyard ops", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(ops_router(ready, registry))
    async with serve_app(app, host, port) as served:
        yield served
