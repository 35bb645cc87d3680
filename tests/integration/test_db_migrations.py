"""The migrations build exactly the schema the models declare, and step back down cleanly."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

import tokenyard.db.api_keys  # noqa: F401  (registers the table)
import tokenyard.db.facilities  # noqa: F401
import tokenyard.db.responses  # noqa: F401
import tokenyard.db.telemetry  # noqa: F401
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


def test_0003_adds_the_telemetry_tables_and_downgrades(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 't.db'}"
    migrate(url)
    tables = {"tel_requests", "tel_spans", "tel_fleet_samples", "tel_rack_samples"}
    assert tables <= set(inspect(make_engine(url)).get_table_names())
    command.downgrade(alembic_config(url), "0002")
    after = set(inspect(make_engine(url)).get_table_names())
    assert not tables & after and "api_keys" in after


def test_0005_adds_the_stored_responses_and_downgrades(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    assert "gw_responses" in inspect(make_engine(url)).get_table_names()
    command.downgrade(alembic_config(url), "0004")
    after = set(inspect(make_engine(url)).get_table_names())
    assert "gw_responses" not in after and "tel_requests" in after
