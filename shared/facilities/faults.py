"""The faults an operator can inject on a rack, and the one request body that asks for one
(the facilities admin API takes it; the telemetry console forwards it as it is)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

FaultKind = Literal["pump_failure", "chiller_failure", "power_cap", "dead_sensor"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class FaultIn(BaseModel):
    kind: FaultKind
    power_cap_kw: float | None = Field(
        default=None, gt=0, description="for kind=power_cap: the lowered cap"
    )
