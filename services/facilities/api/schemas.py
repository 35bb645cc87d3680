"""Request and response bodies of the facilities REST API."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenyard.facilities.faults import FaultKind
from tokenyard.facilities.policy import StateName


class ReadingOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    ts: datetime
    power_kw: float
    supply_c: float | None
    return_c: float | None
    flow_lpm: float | None
    inlet_air_c: float | None
    source: str


class RackOut(BaseModel):
    name: str
    cooling: str
    loop: str | None
    power_cap_kw: float = Field(
        description="the cap in force, lowered while a power_cap fault is injected"
    )
    state: StateName
    reason: str
    since: datetime
    max_seqs_per_worker: int = Field(description="0: no cap in normal, none new in drain")
    worker_ids: list[str]
    latest_reading: ReadingOut | None
    faults: list[FaultKind]
    operator_drain: bool = Field(
        default=False, description="drained by an operator, not by the readings"
    )


class RackList(BaseModel):
    racks: list[RackOut]


class ReadingList(BaseModel):
    rack: str
    readings: list[ReadingOut]


class EventOut(BaseModel):
    rack: str
    ts: datetime
    from_state: StateName
    to_state: StateName
    reason: str
    max_seqs_per_worker: int
    reading: ReadingOut | None


class EventList(BaseModel):
    events: list[EventOut]


class DrainIn(BaseModel):
    reason: str = Field(default="", max_length=500)


class FaultsOut(BaseModel):
    rack: str
    faults: list[FaultKind]


class Health(BaseModel):
    status: Literal["ok"]
    racks: int
    nats_connected: bool


class AutoscaleDesired(BaseModel):
    """The autoscaler's latest decision: how many workers of each pool should run."""

    mode: str  # sla | power
    desired: dict[str, int]  # by role: what the orchestrator should run
    live: dict[str, int]  # by role: workers heard from at that decision
    min_workers: dict[str, int]
    max_workers: dict[str, int]
    reasons: list[str]  # why the counts last changed (empty: never yet)
    blocked_starts: int  # starts wanted that no rack had power budget for
    decided_at: float | None  # unix seconds; None before the first decision
    interval_s: float
