from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayoutDesc(_message.Message):
    __slots__ = ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "hash_version", "tp_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    HASH_VERSION_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_version: str
    tp_size: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., hash_version: _Optional[str] = ..., tp_size: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("request_id", "layout", "src_block_ids", "want_checksums")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    WANT_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayoutDesc
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    want_checksums: bool
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., want_checksums: _Optional[bool] = ...) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("layout", "transports", "host_id", "process_id", "shm_name", "pool_nbytes", "mooncake_endpoint", "pool_address", "block_crc32", "hold_expires_in_s")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    POOL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRC32_FIELD_NUMBER: _ClassVar[int]
    HOLD_EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayoutDesc
    transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    process_id: str
    shm_name: str
    pool_nbytes: int
    mooncake_endpoint: str
    pool_address: int
    block_crc32: _containers.RepeatedScalarFieldContainer[int]
    hold_expires_in_s: float
    def __init__(self, layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., process_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., pool_nbytes: _Optional[int] = ..., mooncake_endpoint: _Optional[str] = ..., pool_address: _Optional[int] = ..., block_crc32: _Optional[_Iterable[int]] = ..., hold_expires_in_s: _Optional[float] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("request_id", "src_block_ids", "chunk_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("offset", "data", "crc32")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    crc32: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("was_held",)
    WAS_HELD_FIELD_NUMBER: _ClassVar[int]
    was_held: bool
    def __init__(self, was_held: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("was_held",)
    WAS_HELD_FIELD_NUMBER: _ClassVar[int]
    was_held: bool
    def __init__(self, was_held: _Optional[bool] = ...) -> None: ...

class PutBlock(_message.Message):
    __slots__ = ("layout", "hash", "data", "crc32")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayoutDesc
    hash: int
    data: bytes
    crc32: int
    def __init__(self, layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., hash: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("num_stored", "num_refused")
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    NUM_REFUSED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    num_refused: int
    def __init__(self, num_stored: _Optional[int] = ..., num_refused: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("layout", "hashes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayoutDesc
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class CachedBlock(_message.Message):
    __slots__ = ("index", "hash", "data", "crc32")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    index: int
    hash: int
    data: bytes
    crc32: int
    def __init__(self, index: _Optional[int] = ..., hash: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("layout", "hashes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayoutDesc
    hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class ContainsReply(_message.Message):
    __slots__ = ("num_prefix",)
    NUM_PREFIX_FIELD_NUMBER: _ClassVar[int]
    num_prefix: int
    def __init__(self, num_prefix: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "bytes", "blocks", "hits", "evictions", "capacity_bytes", "misses")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    name: str
    bytes: int
    blocks: int
    hits: int
    evictions: int
    capacity_bytes: int
    misses: int
    def __init__(self, name: _Optional[str] = ..., bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., misses: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("hits", "misses", "evictions", "tiers")
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    hits: int
    misses: int
    evictions: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...
