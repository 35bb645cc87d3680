from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RackStateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RACK_STATE_UNSPECIFIED: _ClassVar[RackStateKind]
    RACK_STATE_NORMAL: _ClassVar[RackStateKind]
    RACK_STATE_DERATE: _ClassVar[RackStateKind]
    RACK_STATE_DRAIN: _ClassVar[RackStateKind]
RACK_STATE_UNSPECIFIED: RackStateKind
RACK_STATE_NORMAL: RackStateKind
RACK_STATE_DERATE: RackStateKind
RACK_STATE_DRAIN: RackStateKind

class FacilityReading(_message.Message):
    __slots__ = ("rack", "ts_unix_s", "power_kw", "supply_c", "return_c", "flow_lpm", "inlet_air_c", "source")
    RACK_FIELD_NUMBER: _ClassVar[int]
    TS_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    POWER_KW_FIELD_NUMBER: _ClassVar[int]
    SUPPLY_C_FIELD_NUMBER: _ClassVar[int]
    RETURN_C_FIELD_NUMBER: _ClassVar[int]
    FLOW_LPM_FIELD_NUMBER: _ClassVar[int]
    INLET_AIR_C_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    rack: str
    ts_unix_s: float
    power_kw: float
    supply_c: float
    return_c: float
    flow_lpm: float
    inlet_air_c: float
    source: str
    def __init__(self, rack: _Optional[str] = ..., ts_unix_s: _Optional[float] = ..., power_kw: _Optional[float] = ..., supply_c: _Optional[float] = ..., return_c: _Optional[float] = ..., flow_lpm: _Optional[float] = ..., inlet_air_c: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class RackState(_message.Message):
    __slots__ = ("rack", "state", "reason", "since_unix_s", "max_seqs_per_worker", "worker_ids", "sent_unix_s", "heartbeat_s", "seq_fraction", "power_pressure")
    RACK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQS_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    SEQ_FRACTION_FIELD_NUMBER: _ClassVar[int]
    POWER_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    rack: str
    state: RackStateKind
    reason: str
    since_unix_s: float
    max_seqs_per_worker: int
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    sent_unix_s: float
    heartbeat_s: float
    seq_fraction: float
    power_pressure: float
    def __init__(self, rack: _Optional[str] = ..., state: _Optional[_Union[RackStateKind, str]] = ..., reason: _Optional[str] = ..., since_unix_s: _Optional[float] = ..., max_seqs_per_worker: _Optional[int] = ..., worker_ids: _Optional[_Iterable[str]] = ..., sent_unix_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., seq_fraction: _Optional[float] = ..., power_pressure: _Optional[float] = ...) -> None: ...
