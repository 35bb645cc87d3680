"""The migrations build exactly the schema the models declare, and step back down cleanly."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

import tokenyard.db.api_keys  # noqa: F401  (registers the table)
import tokenyard.db.facilities  # noqa: F401
from tokenyard.db import Base, make_engine, migrate
from tokenyard.db.migrate import alembic_config


def test_head_matches_the_models_and_0002_downgrades(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    migrate(url)
    engine = make_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    assert "api_keys" in inspect(engine).get_table_names()

    command.downgrade(alembic_config(url), "0001")
    inspect_after = inspect(make_engine(url))
    assert "api_keys" not in inspect_after.get_table_names()
    assert "fac_racks" in inspect_after.get_table_names()
    engine.dispose()
