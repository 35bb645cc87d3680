"""Conversions between the policy's plain types and the facilities protobuf messages."""

from __future__ import annotations

from tokenyard.facilities.policy import Reading, State
from tokenyard.v1.facilities_pb2 import FacilityReading, RackStateKind

STATE_TO_PROTO: dict[State, RackStateKind] = {
    State.NORMAL: RackStateKind.RACK_STATE_NORMAL,
    State.DERATE: RackStateKind.RACK_STATE_DERATE,
    State.DRAIN: RackStateKind.RACK_STATE_DRAIN,
}
PROTO_TO_STATE = {v: k for k, v in STATE_TO_PROTO.items()}


def reading_to_proto(r: Reading) -> FacilityReading:
    msg = FacilityReading(rack=r.rack, ts_unix_s=r.ts, power_kw=r.power_kw, source=r.source)
    # Optional fields stay unset (not 0.0) when a rack does not measure them.
    for name in ("supply_c", "return_c", "flow_lpm", "inlet_air_c"):
        value = getattr(r, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def reading_from_proto(msg: FacilityReading) -> Reading:
    def opt(name: str) -> float | None:
        return getattr(msg, name) if msg.HasField(name) else None

    return Reading(
        rack=msg.rack,
        ts=msg.ts_unix_s,
        power_kw=msg.power_kw,
        supply_c=opt("supply_c"),
        return_c=opt("return_c"),
        flow_lpm=opt("flow_lpm"),
        inlet_air_c=opt("inlet_air_c"),
        source=msg.source or "external",
    )
