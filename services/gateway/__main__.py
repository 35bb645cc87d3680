"""`python -m tokenyard.services.gateway`: settings from TOKENYARD_GATEWAY_*, then uvicorn."""

from __future__ import annotations

import logging

import uvicorn
from tokenyard.services.gateway.app import create_app
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.tracing import setup_tracing


def main() -> None:
    settings = GatewaySettings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    setup_tracing("gateway")
    # NOTE: uvicorn handles SIGINT/SIGTERM: it stops accepting, then runs lifespan shutdown.
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level
    )


if __name__ == "__main__":
    main()
