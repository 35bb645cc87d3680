"""`python -m tokenyard.services.facilities`: settings from TOKENYARD_FACILITIES_* variables."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pydantic import ValidationError
from tokenyard.services.facilities.service import serve
from tokenyard.services.facilities.settings import FacilitiesSettings


async def main() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(FacilitiesSettings(), stop)  # type: ignore[call-arg]  # required fields come from the environment


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(main())
    except ValidationError as exc:
        sys.exit(f"facilities: bad settings (TOKENYARD_FACILITIES_*):\n{exc}")
