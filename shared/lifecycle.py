"""How every service process runs: until SIGINT or SIGTERM, then a graceful stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `serve(stop)` on a fresh event loop; SIGINT/SIGTERM set `stop`, and `serve` is
    expected to wind down (drain NATS, stop servers) once it is set."""

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    asyncio.run(run())
