"""Alembic environment: the URL comes from the Config built by tokenyard.db.migrate."""

from __future__ import annotations

from alembic import context
from sqlalchemy import pool

import tokenyard.db.api_keys  # noqa: F401  (registers the tables on Base.metadata)
import tokenyard.db.facilities  # noqa: F401
import tokenyard.db.responses  # noqa: F401
import tokenyard.db.telemetry  # noqa: F401
from tokenyard.db.base import Base
from tokenyard.db.engine import make_engine

target_metadata = Base.metadata


def run_offline() -> None:
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    url = context.config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url is not set"
    engine = make_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        # render_as_batch: SQLite alters tables by copying them; Alembic does that in batch mode.
        context.configure(
            connection=connection, target_metadata=target_metadata, render_as_batch=True
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
