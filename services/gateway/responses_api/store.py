"""ResponseStore: the gateway's stored responses in SQL, each readable only by the tenant
that created it, kept for `retention_s` (0: until deleted).

Calls block (SQLAlchemy sessions): routes run them in a thread.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, or_, select
from sqlalchemy.orm import Session, sessionmaker

from tokenyard.db import default_url, make_engine, make_sessionmaker, migrate
from tokenyard.db.responses import StoredResponse


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Stored:
    """A stored response as the routes need it."""

    response: dict[str, Any]
    context: list[dict[str, Any]]  # the input items of its whole chain

    def history(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from: its inputs, then its output."""
        return [*self.context, *self.response.get("output", [])]


class ResponseStore:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        retention_s: float,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        self.sessions, self.retention_s, self.clock = sessions, retention_s, clock
        self._tmpdir: str | None = None  # a private SQLite file's folder, removed on close

    @classmethod
    def open(cls, url: str | None, retention_s: float) -> ResponseStore:
        """The store at `url`, its schema brought up to date first; None = a SQLite file of
        this process's own, removed by close()."""
        tmpdir = None
        if url is None:
            tmpdir = tempfile.mkdtemp(prefix="tokenyard-responses-")
            url = default_url(tmpdir, "responses.db")
        migrate(url)
        store = cls(make_sessionmaker(make_engine(url)), retention_s)
        store._tmpdir = tmpdir
        return store

    def close(self) -> None:
        bind = self.sessions.kw.get("bind")
        if bind is not None:
            bind.dispose()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def save(self, owner: str, response: dict[str, Any], context: list[dict[str, Any]]) -> None:
        now = self.clock()
        expires = now + timedelta(seconds=self.retention_s) if self.retention_s else None
        row = StoredResponse(
            id=response["id"],
            owner=owner,
            created_at=now,
            expires_at=expires,
            response=response,
            context=context,
        )
        with self.sessions.begin() as session:
            session.add(row)

    def get(self, response_id: str, owner: str) -> Stored | None:
        """The response when it exists, belongs to `owner` and has not expired."""
        with self.sessions() as session:
            row = session.scalar(self._live(response_id, owner))
            return None if row is None else Stored(row.response, row.context)

    def delete(self, response_id: str, owner: str) -> bool:
        with self.sessions.begin() as session:
            row = session.scalar(self._live(response_id, owner))
            if row is None:
                return False
            session.delete(row)
        return True

    def purge(self) -> int:
        """Delete every expired response; how many went."""
        with self.sessions.begin() as session:
            result = session.execute(
                delete(StoredResponse).where(StoredResponse.expires_at <= self.clock())
            )
        return int(getattr(result, "rowcount", 0) or 0)

    def _live(self, response_id: str, owner: str) -> Any:
        return select(StoredResponse).where(
            StoredResponse.id == response_id,
            StoredResponse.owner == owner,
            or_(StoredResponse.expires_at.is_(None), StoredResponse.expires_at > self.clock()),
        )
