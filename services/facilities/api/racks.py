"""/v1/racks: each rack with its latest reading and state; its readings over a time range."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query

from tokenyard.api_errors import ApiError
from tokenyard.services.facilities.api.deps import Monitor, Rack, Store
from tokenyard.services.facilities.api.schemas import RackList, RackOut, ReadingList, ReadingOut
from tokenyard.services.facilities.monitor import RackMonitor, RackRuntime
from tokenyard.services.facilities.store import to_datetime

router = APIRouter(prefix="/v1/racks", tags=["racks"])

DEFAULT_WINDOW = timedelta(hours=1)
Start = Annotated[datetime | None, Query(description="ISO 8601; default: one hour before end")]
End = Annotated[datetime | None, Query(description="ISO 8601; default: now")]
Limit = Annotated[int, Query(ge=1, le=10_000, description="the most recent this many in the range")]


def time_range(start: datetime | None, end: datetime | None) -> tuple[datetime, datetime]:
    """Naive times are UTC; the default window is the last hour."""
    end = _aware(end) if end else datetime.now(UTC)
    start = _aware(start) if start else end - DEFAULT_WINDOW
    if start > end:
        raise ApiError(400, "start is after end", code="invalid_range", param="start")
    return start, end


def _aware(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


def rack_out(monitor: RackMonitor, rt: RackRuntime) -> RackOut:
    latest = rt.latest
    reading = None
    if latest is not None:
        reading = ReadingOut(
            ts=to_datetime(latest.ts),
            power_kw=latest.power_kw,
            supply_c=latest.supply_c,
            return_c=latest.return_c,
            flow_lpm=latest.flow_lpm,
            inlet_air_c=latest.inlet_air_c,
            source=latest.source,
        )
    return RackOut(
        name=rt.spec.name,
        cooling=rt.spec.cooling,
        loop=rt.spec.loop,
        power_cap_kw=rt.limits.power_cap_kw,
        state=rt.status.state.label,
        reason=rt.status.reason,
        since=to_datetime(rt.status.since),
        max_seqs_per_worker=monitor.seq_cap(rt),
        worker_ids=rt.spec.worker_ids,
        latest_reading=reading,
        faults=rt.faults.active(),
        operator_drain=bool(rt.operator_drain),
    )


@router.get("")
async def list_racks(monitor: Monitor) -> RackList:
    return RackList(racks=[rack_out(monitor, rt) for rt in monitor.racks.values()])


@router.get("/{rack}")
async def get_rack(monitor: Monitor, rt: Rack) -> RackOut:
    return rack_out(monitor, rt)


@router.get("/{rack}/readings")
async def rack_readings(
    rt: Rack, store: Store, start: Start = None, end: End = None, limit: Limit = 1000
) -> ReadingList:
    lo, hi = time_range(start, end)
    rows = await asyncio.to_thread(store.readings, rt.spec.name, lo, hi, limit)
    return ReadingList(rack=rt.spec.name, readings=[ReadingOut.model_validate(r) for r in rows])
