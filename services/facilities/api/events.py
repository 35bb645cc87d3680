"""/v1/events: state changes (normal / derate / drain) with their reasons and causing readings."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query

from tokenyard.api_errors import ApiError
from tokenyard.db.facilities import StateEvent
from tokenyard.services.facilities.api.deps import Monitor, Store
from tokenyard.services.facilities.api.racks import End, Limit, Start, time_range
from tokenyard.services.facilities.api.schemas import EventList, EventOut, ReadingOut

router = APIRouter(prefix="/v1/events", tags=["events"])


def event_out(e: StateEvent) -> EventOut:
    return EventOut(
        rack=e.rack.name,
        ts=e.ts,
        from_state=e.from_state,  # type: ignore[arg-type]  # stored from State labels
        to_state=e.to_state,  # type: ignore[arg-type]
        reason=e.reason,
        max_seqs_per_worker=e.max_seqs_per_worker,
        reading=ReadingOut.model_validate(e.reading) if e.reading else None,
    )


@router.get("")
async def list_events(
    monitor: Monitor,
    store: Store,
    rack: Annotated[str | None, Query(description="only this rack")] = None,
    start: Start = None,
    end: End = None,
    limit: Limit = 1000,
) -> EventList:
    if rack is not None and rack not in monitor.racks:
        raise ApiError(404, f"no rack named {rack!r}", code="rack_not_found", param="rack")
    lo, hi = time_range(start, end)
    rows = await asyncio.to_thread(store.events, rack, lo, hi, limit)
    return EventList(events=[event_out(e) for e in rows])
