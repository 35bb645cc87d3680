"""`python -m tokenyard.services.kvcache`: settings from TOKENYARD_KVCACHE_*, then serve
until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pydantic import ValidationError
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings


async def main(settings: KVCacheSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await serve(settings)
    try:
        await stop.wait()
    finally:
        await server.stop()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = KVCacheSettings()
    except ValidationError as exc:
        sys.exit(f"kvcache: bad settings (TOKENYARD_KVCACHE_*):\n{exc}")
    asyncio.run(main(settings))
