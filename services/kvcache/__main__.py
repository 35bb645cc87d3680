"""`python -m tokenyard.services.kvcache`: settings from TOKENYARD_KVCACHE_*, then serve
until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import REGISTRY

from tokenyard.http_server import ReadyFlag, ops_server
from tokenyard.lifecycle import run_until_signalled, settings_or_exit
from tokenyard.services.kvcache.metrics import StoreCollector
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings


async def main(settings: KVCacheSettings, stop: asyncio.Event) -> None:
    ready = ReadyFlag()
    async with ops_server(settings.ops_host, settings.ops_port, ready=ready) as ops:
        server = await serve(settings)
        REGISTRY.register(StoreCollector(server.store))
        ready.set(None)
        logging.getLogger(__name__).info("KV cache ops on %s", ops.url)
        try:
            await stop.wait()
        finally:
            ready.set("stopping")
            await server.stop()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_or_exit(KVCacheSettings, "kvcache")
    run_until_signalled(lambda stop: main(settings, stop))
