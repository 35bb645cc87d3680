"""Relational persistence: SQLAlchemy 2 models, engine/session helpers, Alembic migrations.

SQLite file by default, PostgreSQL when a URL is given. The schema is owned by the
migrations in ``migrations/``; :func:`migrate` brings any database to the latest one.
"""

from tokenyard.db.base import Base
from tokenyard.db.engine import default_url, make_engine, make_sessionmaker
from tokenyard.db.migrate import migrate

__all__ = ["Base", "default_url", "make_engine", "make_sessionmaker", "migrate"]
