"""`python -m tokenyard.services.facilities`: settings from TOKENYARD_FACILITIES_* variables."""

from __future__ import annotations

import asyncio
import logging
import sys

from pydantic import ValidationError

from tokenyard.lifecycle import run_until_signalled
from tokenyard.services.facilities.service import serve
from tokenyard.services.facilities.settings import FacilitiesSettings


async def main(stop: asyncio.Event) -> None:
    await serve(FacilitiesSettings(), stop)  # type: ignore[call-arg]  # required fields come from the environment


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        run_until_signalled(main)
    except ValidationError as exc:
        sys.exit(f"facilities: bad settings (TOKENYARD_FACILITIES_*):\n{exc}")
