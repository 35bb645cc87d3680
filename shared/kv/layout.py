"""What a KV block pool looks like in memory, so two ends can agree before bytes move.

The engine keeps one preallocated pool per worker, block-major so that one block's keys
and values for every layer are a single contiguous region (one memcpy, one RDMA write,
one gRPC chunk per block):

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
                   |            |     |
                   |            |     +-- 0 = keys, 1 = values
                   |            +-------- transformer layer
                   +--------------------- physical block id (what block tables hold)

A token at logical position p of a sequence lives in block ``block_table[p // block_size]``
at offset ``p % block_size``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.v1 import kv_pb2

if TYPE_CHECKING:
    import torch

# NOTE: no torch at import: the KV-cache service handles layouts and bytes only, and
# importing torch would cost it about 200 MiB of resident memory.
_ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
KV_DTYPES = frozenset(_ITEMSIZES)


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # one of _ITEMSIZES
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_version: str = HASH_SPEC_VERSION
    # Tensor parallelism: the model's KV heads are split over this many ranks, each with a
    # pool of its own; num_kv_heads is one rank's share. Blocks cross an engine's boundary
    # (hand-offs, the KV-cache service) only in the whole-head layout, tp_size 1: see
    # whole_heads() and tokenyard.kv.tp_layout.
    tp_size: int = 1

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return {
            "float32": torch.float32,
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "float8_e4m3fn": torch.float8_e4m3fn,
        }[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = _ITEMSIZES[self.dtype]
        for d in self.block_shape:
            n *= d
        return n

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def whole_heads(self) -> KVLayout:
        """The layout of the same blocks with every rank's heads together (tp_size 1): what
        a block of a tensor-parallel engine looks like once its ranks' shares are gathered."""
        return replace(self, num_kv_heads=self.num_kv_heads * self.tp_size, tp_size=1)

    def mismatch(self, other: KVLayout) -> str | None:
        """A human-readable reason the two layouts cannot exchange blocks, or None."""
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
        if not diffs:
            return None
        return "KV layout mismatch (" + ", ".join(diffs) + ")"

    @staticmethod
    def dtype_name(dtype: torch.dtype) -> str:
        name = str(dtype).removeprefix("torch.")
        if name not in _ITEMSIZES:
            raise ValueError(f"unsupported KV dtype {dtype}")
        return name


def layout_to_proto(layout: KVLayout) -> kv_pb2.KVLayoutDesc:
    return kv_pb2.KVLayoutDesc(
        model_id=layout.model_id,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        hash_version=layout.hash_version,
        tp_size=layout.tp_size,
    )


def layout_from_proto(desc: kv_pb2.KVLayoutDesc) -> KVLayout:
    return KVLayout(
        model_id=desc.model_id,
        dtype=desc.dtype,
        block_size=desc.block_size,
        num_layers=desc.num_layers,
        num_kv_heads=desc.num_kv_heads,
        head_dim=desc.head_dim,
        hash_version=desc.hash_version,
        tp_size=desc.tp_size or 1,  # an older peer sends none: one rank
    )
