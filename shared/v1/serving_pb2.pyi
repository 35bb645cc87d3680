from tokenyard.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "logprobs", "cache_salt", "min_tokens", "logit_bias", "guided", "pooling", "priority", "tenant", "lora")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    cache_salt: str
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    guided: GuidedDecoding
    pooling: str
    priority: int
    tenant: str
    lora: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., cache_salt: _Optional[str] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., guided: _Optional[_Union[GuidedDecoding, _Mapping]] = ..., pooling: _Optional[str] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., lora: _Optional[str] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "num_prompt_tokens", "block_hashes", "hash_version", "max_tokens", "priority", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASH_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    num_prompt_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    hash_version: str
    max_tokens: int
    priority: int
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., hash_version: _Optional[str] = ..., max_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., lora: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "disaggregated", "reason", "expected_cached_tokens")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    disaggregated: bool
    reason: str
    expected_cached_tokens: int
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., disaggregated: _Optional[bool] = ..., reason: _Optional[str] = ..., expected_cached_tokens: _Optional[int] = ...) -> None: ...

class RouteError(_message.Message):
    __slots__ = ("code", "message", "retry_after_s")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[RouteError.Code]
        NO_WORKERS: _ClassVar[RouteError.Code]
        ALL_DRAINED: _ClassVar[RouteError.Code]
        OVERLOADED: _ClassVar[RouteError.Code]
        UNKNOWN_MODEL: _ClassVar[RouteError.Code]
        CONTEXT_TOO_LONG: _ClassVar[RouteError.Code]
    CODE_UNSPECIFIED: RouteError.Code
    NO_WORKERS: RouteError.Code
    ALL_DRAINED: RouteError.Code
    OVERLOADED: RouteError.Code
    UNKNOWN_MODEL: RouteError.Code
    CONTEXT_TOO_LONG: RouteError.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    code: RouteError.Code
    message: str
    retry_after_s: int
    def __init__(self, code: _Optional[_Union[RouteError.Code, str]] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[int] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("placement", "error")
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    placement: Placement
    error: RouteError
    def __init__(self, placement: _Optional[_Union[Placement, _Mapping]] = ..., error: _Optional[_Union[RouteError, _Mapping]] = ...) -> None: ...

class PrefillJob(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "params", "decode_worker_id", "arrival_unix_ns", "gateway_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    decode_worker_id: str
    arrival_unix_ns: int
    gateway_id: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., arrival_unix_ns: _Optional[int] = ..., gateway_id: _Optional[str] = ...) -> None: ...

class DecodeHandoff(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "output_token_ids", "params", "prefill_worker_id", "kv_endpoint", "src_block_ids", "num_cached_tokens", "arrival_unix_ns", "gateway_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    prefill_worker_id: str
    kv_endpoint: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    arrival_unix_ns: int
    gateway_id: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_worker_id: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., arrival_unix_ns: _Optional[int] = ..., gateway_id: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[Error.Code]
        INVALID_REQUEST: _ClassVar[Error.Code]
        INTERNAL: _ClassVar[Error.Code]
        CANCELLED: _ClassVar[Error.Code]
        OVERLOADED: _ClassVar[Error.Code]
    CODE_UNSPECIFIED: Error.Code
    INVALID_REQUEST: Error.Code
    INTERNAL: Error.Code
    CANCELLED: Error.Code
    OVERLOADED: Error.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: Error.Code
    message: str
    def __init__(self, code: _Optional[_Union[Error.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "error", "worker_id", "handed_to", "embedding", "energy_joules", "energy_joules_measured", "energy_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HANDED_TO_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_FIELD_NUMBER: _ClassVar[int]
    ENERGY_JOULES_MEASURED_FIELD_NUMBER: _ClassVar[int]
    ENERGY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finished: bool
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: Error
    worker_id: str
    handed_to: str
    embedding: _containers.RepeatedScalarFieldContainer[float]
    energy_joules: float
    energy_joules_measured: float
    energy_source: str
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., worker_id: _Optional[str] = ..., handed_to: _Optional[str] = ..., embedding: _Optional[_Iterable[float]] = ..., energy_joules: _Optional[float] = ..., energy_joules_measured: _Optional[float] = ..., energy_source: _Optional[str] = ...) -> None: ...

class JobMoved(_message.Message):
    __slots__ = ("request_id", "from_worker_id", "to_worker_id", "decode_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_worker_id: str
    to_worker_id: str
    decode_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., from_worker_id: _Optional[str] = ..., to_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Replay(_message.Message):
    __slots__ = ("request_id", "from_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_index: int
    def __init__(self, request_id: _Optional[str] = ..., from_index: _Optional[int] = ...) -> None: ...

class WorkerHeartbeat(_message.Message):
    __slots__ = ("worker_id", "role", "model", "num_running", "num_waiting", "num_free_blocks", "num_blocks", "max_num_seqs", "tokens_per_s", "kv_endpoint", "host", "sent_unix_ms", "block_size", "heartbeat_interval_ms", "max_model_len", "seq_cap", "step_fixed_ms", "step_ms_per_token", "pending_prompt_tokens", "local_prefill", "not_ready", "kv_epoch", "kv_seq", "draining", "control_endpoint", "ops_endpoint", "kv_layout", "kvcache_fetch_ms_per_block", "lora_adapters", "lora_room", "lora_paths", "kvcache_offload_bytes", "kvcache_fetch_bytes")
    class LoraPathsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SEQ_CAP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIXED_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PENDING_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NOT_READY_FIELD_NUMBER: _ClassVar[int]
    KV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    KV_SEQ_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OPS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KVCACHE_FETCH_MS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LORA_ROOM_FIELD_NUMBER: _ClassVar[int]
    LORA_PATHS_FIELD_NUMBER: _ClassVar[int]
    KVCACHE_OFFLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    KVCACHE_FETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    max_num_seqs: int
    tokens_per_s: float
    kv_endpoint: str
    host: str
    sent_unix_ms: int
    block_size: int
    heartbeat_interval_ms: int
    max_model_len: int
    seq_cap: int
    step_fixed_ms: float
    step_ms_per_token: float
    pending_prompt_tokens: int
    local_prefill: bool
    not_ready: str
    kv_epoch: str
    kv_seq: int
    draining: bool
    control_endpoint: str
    ops_endpoint: str
    kv_layout: _kv_pb2.KVLayoutDesc
    kvcache_fetch_ms_per_block: float
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    lora_room: int
    lora_paths: _containers.ScalarMap[str, str]
    kvcache_offload_bytes: int
    kvcache_fetch_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., kv_endpoint: _Optional[str] = ..., host: _Optional[str] = ..., sent_unix_ms: _Optional[int] = ..., block_size: _Optional[int] = ..., heartbeat_interval_ms: _Optional[int] = ..., max_model_len: _Optional[int] = ..., seq_cap: _Optional[int] = ..., step_fixed_ms: _Optional[float] = ..., step_ms_per_token: _Optional[float] = ..., pending_prompt_tokens: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., not_ready: _Optional[str] = ..., kv_epoch: _Optional[str] = ..., kv_seq: _Optional[int] = ..., draining: _Optional[bool] = ..., control_endpoint: _Optional[str] = ..., ops_endpoint: _Optional[str] = ..., kv_layout: _Optional[_Union[_kv_pb2.KVLayoutDesc, _Mapping]] = ..., kvcache_fetch_ms_per_block: _Optional[float] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., lora_room: _Optional[int] = ..., lora_paths: _Optional[_Mapping[str, str]] = ..., kvcache_offload_bytes: _Optional[int] = ..., kvcache_fetch_bytes: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("worker_id", "kind", "block_hashes", "hash_version", "seq", "epoch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        STORED: _ClassVar[KVEvent.Kind]
        REMOVED: _ClassVar[KVEvent.Kind]
        CLEARED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    STORED: KVEvent.Kind
    REMOVED: KVEvent.Kind
    CLEARED: KVEvent.Kind
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASH_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kind: KVEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    hash_version: str
    seq: int
    epoch: str
    def __init__(self, worker_id: _Optional[str] = ..., kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., hash_version: _Optional[str] = ..., seq: _Optional[int] = ..., epoch: _Optional[str] = ...) -> None: ...

class KVResyncRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class KVDump(_message.Message):
    __slots__ = ("worker_id", "epoch", "seq", "block_hashes", "hash_version", "truncated")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASH_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: str
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    hash_version: str
    truncated: bool
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[str] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., hash_version: _Optional[str] = ..., truncated: _Optional[bool] = ...) -> None: ...

class HandoffAck(_message.Message):
    __slots__ = ("request_id", "accepted", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted: bool
    message: str
    def __init__(self, request_id: _Optional[str] = ..., accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class LoRAAdapterRequest(_message.Message):
    __slots__ = ("action", "lora_name", "lora_path")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[LoRAAdapterRequest.Action]
        LOAD: _ClassVar[LoRAAdapterRequest.Action]
        UNLOAD: _ClassVar[LoRAAdapterRequest.Action]
    ACTION_UNSPECIFIED: LoRAAdapterRequest.Action
    LOAD: LoRAAdapterRequest.Action
    UNLOAD: LoRAAdapterRequest.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    action: LoRAAdapterRequest.Action
    lora_name: str
    lora_path: str
    def __init__(self, action: _Optional[_Union[LoRAAdapterRequest.Action, str]] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoRAAdapterReply(_message.Message):
    __slots__ = ("ok", "status", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    status: int
    message: str
    def __init__(self, ok: _Optional[bool] = ..., status: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
