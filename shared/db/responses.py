"""Stored responses of the gateway's Responses API: what `previous_response_id` continues,
and what GET /v1/responses/{id} returns, kept until `expires_at` (the retention setting).

Each row holds its whole conversation (`context`: the input items of every response in
its chain, in order, without instructions), so continuing one is a single read and a
deleted ancestor does not break its descendants.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from tokenyard.db.base import Base, UTCDateTime


class StoredResponse(Base):
    __tablename__ = "gw_responses"
    __table_args__ = (Index("ix_gw_responses_expires_at", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Who may read it: the caller's tenant ("" on a gateway without API keys).
    owner: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    response: Mapped[dict[str, Any]] = mapped_column(JSON)  # the Response object as returned
    context: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # input items, whole chain
