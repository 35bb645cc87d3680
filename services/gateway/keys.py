"""API keys kept in SQL: created, listed, revoked, and checked on every request.

A key reads ``ty-<prefix>.<secret>``. The prefix names the key (lists, logs, rate-limit
buckets); only the SHA-256 of the secret is stored, so a copy of the database gives no key.
Checks are cached for a few seconds per key: a revocation takes effect within `cache_s`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tokenyard.db import make_engine, make_sessionmaker, migrate
from tokenyard.db.api_keys import ApiKey

KEY_PREFIX = "ty-"


@dataclass(frozen=True)
class KeyInfo:
    """What the gateway needs of a key once it is known to be valid."""

    prefix: str
    name: str
    tenant: str
    requests_per_minute: int | None
    tokens_per_minute: int | None


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_key(key: str) -> tuple[str, str] | None:
    """(prefix, secret) of a well-formed key, else None."""
    if not key.startswith(KEY_PREFIX) or "." not in key:
        return None
    prefix, _, secret = key[len(KEY_PREFIX) :].partition(".")
    return (prefix, secret) if prefix and secret else None


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.prefix, row.name, row.tenant, row.requests_per_minute, row.tokens_per_minute)


class KeyStore:
    def __init__(self, sessions: sessionmaker[Session], cache_s: float = 5.0, clock=time.monotonic):
        self.sessions, self.cache_s, self.clock = sessions, cache_s, clock
        self._cache: dict[str, tuple[float, tuple[str, KeyInfo] | None]] = {}

    @classmethod
    def open(cls, url: str, cache_s: float = 5.0) -> KeyStore:
        """The store at `url`, its schema brought up to date first."""
        migrate(url)
        return cls(make_sessionmaker(make_engine(url)), cache_s)

    def create(
        self,
        name: str,
        tenant: str | None = None,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
    ) -> tuple[str, KeyInfo]:
        """A new key: the full key (shown once, never stored) and its record."""
        prefix, secret = secrets.token_hex(4), secrets.token_urlsafe(32)
        row = ApiKey(
            prefix=prefix,
            secret_sha256=_digest(secret),
            name=name,
            tenant=tenant or name,
            requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute,
            created_at=datetime.now(UTC),
        )
        with self.sessions.begin() as session:
            session.add(row)
        return f"{KEY_PREFIX}{prefix}.{secret}", _info(row)

    def list(self) -> list[ApiKey]:
        with self.sessions() as session:
            return list(session.scalars(select(ApiKey).order_by(ApiKey.id)))

    def revoke(self, prefix: str) -> bool:
        """True when a live key with this prefix was revoked."""
        with self.sessions.begin() as session:
            row = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
            if row is None or row.revoked_at is not None:
                return False
            row.revoked_at = datetime.now(UTC)
        self._cache.pop(prefix, None)
        return True

    def verify(self, key: str) -> KeyInfo | None:
        """The key's record when it is valid and not revoked, else None."""
        parts = split_key(key)
        if parts is None:
            return None
        prefix, secret = parts
        now = self.clock()
        cached = self._cache.get(prefix)
        if cached is None or now - cached[0] > self.cache_s:
            cached = (now, self._load(prefix))
            self._cache[prefix] = cached
        found = cached[1]
        if found is None or not hmac.compare_digest(found[0], _digest(secret)):
            return None
        return found[1]

    def _load(self, prefix: str) -> tuple[str, KeyInfo] | None:
        """(stored digest, record) of a live key with this prefix."""
        with self.sessions() as session:
            row = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
            if row is None or row.revoked_at is not None:
                return None
            return row.secret_sha256, _info(row)
