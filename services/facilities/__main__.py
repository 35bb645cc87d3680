"""`python -m tokenyard.services.facilities`: settings from TOKENYARD_FACILITIES_* variables."""

from __future__ import annotations

import asyncio
import logging

from tokenyard.lifecycle import run_until_signalled, settings_or_exit
from tokenyard.services.facilities.service import serve
from tokenyard.services.facilities.settings import FacilitiesSettings


async def main(settings: FacilitiesSettings, stop: asyncio.Event) -> None:
    await serve(settings, stop)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_or_exit(FacilitiesSettings, "facilities")
    run_until_signalled(lambda stop: main(settings, stop))
