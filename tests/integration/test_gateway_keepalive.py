"""The gateway's server keeps an idle client connection open past a client pool's expiry.

uvicorn's own default closes one after 5 s, the same moment httpx's pool gives it up: a
request sent on it then can meet the close and fail with a reset connection, no answer
(seen as a cut stream in the chaos test). Served for real, over TCP, with the config the
gateway's entry point uses."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn
from fastapi import FastAPI, Request

from tokenyard.bus.embedded import free_port
from tokenyard.services.gateway.__main__ import server_config
from tokenyard.services.gateway.settings import GatewaySettings

IDLE_S = 6.0  # past uvicorn's default keep-alive of 5 s


def client_port_app() -> FastAPI:
    app = FastAPI()

    @app.get("/port")
    async def port(request: Request) -> dict:
        assert request.client is not None
        return {"port": request.client.port}

    return app


async def test_an_idle_connection_is_still_open_after_six_seconds():
    settings = GatewaySettings(port=free_port(), log_level="warning")
    server = uvicorn.Server(server_config(client_port_app(), settings))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.05)
        limits = httpx.Limits(max_connections=1, keepalive_expiry=60)
        url = f"http://{settings.host}:{settings.port}/port"
        async with httpx.AsyncClient(limits=limits) as client:
            first = (await client.get(url)).json()["port"]
            await asyncio.sleep(IDLE_S)
            second = (await client.get(url)).json()["port"]
        assert second == first, "the server closed the idle connection; the client reconnected"
    finally:
        server.should_exit = True
        await task
