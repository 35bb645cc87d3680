"""Alembic migrations for tokenyard.db (shipped with the package)."""
