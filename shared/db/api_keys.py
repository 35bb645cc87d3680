"""API keys: only a hash of each secret is stored, with its per-minute limits.

A key reads ``ty-<prefix>.<secret>``; the prefix is public (it names the key in lists and
logs), the secret is shown once at creation and stored as SHA-256 (the secret is 32 random
bytes, so a slow password hash adds nothing).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Index, String
from sqlalchemy.orm import Mapped, mapped_column

from tokenyard.db.base import Base, UTCDateTime


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (Index("ix_api_keys_tenant", "tenant"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(128))
    # Keys of one tenant share a KV-cache salt; a tenant never reads another's prefixes.
    tenant: Mapped[str] = mapped_column(String(128))
    requests_per_minute: Mapped[int | None]
    tokens_per_minute: Mapped[int | None]
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
