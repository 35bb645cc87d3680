"""Engines and sessions: SQLite under a data directory by default, any SQLAlchemy URL otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def default_url(data_dir: str | Path, name: str = "tokenyard.db") -> str:
    path = Path(data_dir).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / name}"


def make_engine(url: str, **kwargs: Any) -> Engine:
    engine = create_engine(url, pool_pre_ping=True, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    # NOTE: expire_on_commit=False: rows are read after commit, outside the session, by the API.
    return sessionmaker(engine, expire_on_commit=False)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    # WAL lets the API read while the monitor writes.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()
