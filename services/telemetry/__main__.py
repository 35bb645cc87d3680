"""`python -m tokenyard.services.telemetry`: settings from TOKENYARD_TELEMETRY_*, then serve
until SIGINT/SIGTERM."""

from __future__ import annotations

import logging

from tokenyard.lifecycle import run_until_signalled, settings_or_exit
from tokenyard.services.telemetry.service import serve
from tokenyard.services.telemetry.settings import TelemetrySettings


def main() -> None:
    settings = settings_or_exit(TelemetrySettings, "telemetry")
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s telemetry %(levelname)s %(message)s"
    )
    run_until_signalled(lambda stop: serve(settings, stop))


if __name__ == "__main__":
    main()
