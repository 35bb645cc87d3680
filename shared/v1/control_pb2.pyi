from tokenyard.v1 import facilities_pb2 as _facilities_pb2
from tokenyard.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerDrainRequest(_message.Message):
    __slots__ = ("reason", "wait_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    wait_s: float
    def __init__(self, reason: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class WorkerUndrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "model", "state", "drain_reason", "num_running", "num_waiting", "num_requests", "num_blocks", "num_free_blocks", "kv_used", "kv_endpoint")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[WorkerStatus.State]
        SERVING: _ClassVar[WorkerStatus.State]
        DRAINING: _ClassVar[WorkerStatus.State]
        DRAINED: _ClassVar[WorkerStatus.State]
    STATE_UNSPECIFIED: WorkerStatus.State
    SERVING: WorkerStatus.State
    DRAINING: WorkerStatus.State
    DRAINED: WorkerStatus.State
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model: str
    state: WorkerStatus.State
    drain_reason: str
    num_running: int
    num_waiting: int
    num_requests: int
    num_blocks: int
    num_free_blocks: int
    kv_used: float
    kv_endpoint: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[_Union[WorkerStatus.State, str]] = ..., drain_reason: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_used: _Optional[float] = ..., kv_endpoint: _Optional[str] = ...) -> None: ...

class ListRacksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RackInfo(_message.Message):
    __slots__ = ("state", "faults", "power_cap_kw", "operator_drain")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    POWER_CAP_KW_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_DRAIN_FIELD_NUMBER: _ClassVar[int]
    state: _facilities_pb2.RackState
    faults: _containers.RepeatedScalarFieldContainer[str]
    power_cap_kw: float
    operator_drain: bool
    def __init__(self, state: _Optional[_Union[_facilities_pb2.RackState, _Mapping]] = ..., faults: _Optional[_Iterable[str]] = ..., power_cap_kw: _Optional[float] = ..., operator_drain: _Optional[bool] = ...) -> None: ...

class ListRacksReply(_message.Message):
    __slots__ = ("racks",)
    RACKS_FIELD_NUMBER: _ClassVar[int]
    racks: _containers.RepeatedCompositeFieldContainer[RackInfo]
    def __init__(self, racks: _Optional[_Iterable[_Union[RackInfo, _Mapping]]] = ...) -> None: ...

class SetFaultRequest(_message.Message):
    __slots__ = ("rack", "kind", "power_cap_kw")
    RACK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    POWER_CAP_KW_FIELD_NUMBER: _ClassVar[int]
    rack: str
    kind: str
    power_cap_kw: float
    def __init__(self, rack: _Optional[str] = ..., kind: _Optional[str] = ..., power_cap_kw: _Optional[float] = ...) -> None: ...

class RackRequest(_message.Message):
    __slots__ = ("rack",)
    RACK_FIELD_NUMBER: _ClassVar[int]
    rack: str
    def __init__(self, rack: _Optional[str] = ...) -> None: ...

class DrainRackRequest(_message.Message):
    __slots__ = ("rack", "reason")
    RACK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rack: str
    reason: str
    def __init__(self, rack: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearReply(_message.Message):
    __slots__ = ("blocks", "bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class EvictPrefixRequest(_message.Message):
    __slots__ = ("layout", "hashes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    layout: _kv_pb2.KVLayoutDesc
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[_Union[_kv_pb2.KVLayoutDesc, _Mapping]] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class EvictPrefixReply(_message.Message):
    __slots__ = ("num_evicted",)
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_evicted: int
    def __init__(self, num_evicted: _Optional[int] = ...) -> None: ...
