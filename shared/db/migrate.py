"""Run the packaged Alembic migrations programmatically: ``migrate(url)`` = ``upgrade head``."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # NOTE: '%' must be doubled for configparser; URLs may carry percent-encoded options.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)
