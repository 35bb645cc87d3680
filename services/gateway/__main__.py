"""`python -m tokenyard.services.gateway`: settings from TOKENYARD_GATEWAY_*, then uvicorn."""

from __future__ import annotations

import logging
import math

import uvicorn
from fastapi import FastAPI

from tokenyard.lifecycle import settings_or_exit
from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.tracing import setup_tracing


def server_config(app: FastAPI, settings: GatewaySettings) -> uvicorn.Config:
    # NOTE: uvicorn handles SIGINT/SIGTERM: it stops accepting, gives open requests
    # `shutdown_grace_s` (cut streams cancel their requests on the workers), then runs the
    # lifespan shutdown, which drains the NATS connection.
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s),  # whole seconds
        timeout_keep_alive=settings.keep_alive_s,
    )


def main() -> None:
    settings = settings_or_exit(GatewaySettings, "gateway")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    setup_tracing("gateway")
    uvicorn.Server(server_config(create_app(settings), settings)).run()


if __name__ == "__main__":
    main()
