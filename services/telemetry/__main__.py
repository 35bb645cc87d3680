"""`python -m tokenyard.services.telemetry`: settings from TOKENYARD_TELEMETRY_*, then serve
until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import sys

from pydantic import ValidationError

from tokenyard.lifecycle import run_until_signalled
from tokenyard.services.telemetry.service import serve
from tokenyard.services.telemetry.settings import TelemetrySettings


def main() -> None:
    try:
        settings = TelemetrySettings()
    except ValidationError as exc:
        sys.exit(f"telemetry: bad settings (TOKENYARD_TELEMETRY_*):\n{exc}")
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s telemetry %(levelname)s %(message)s"
    )
    run_until_signalled(lambda stop: serve(settings, stop))


if __name__ == "__main__":
    main()
