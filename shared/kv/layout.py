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

from dataclasses import asdict, dataclass

import torch

from tokenyard.kv.hashing import HASH_SPEC_VERSION

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str  # one of _DTYPES
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_version: str = HASH_SPEC_VERSION
    # Tensor parallelism: the model's KV heads are split over this many ranks, each with a
    # pool of its own; num_kv_heads is one rank's share.
    tp_size: int = 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.block_shape:
            n *= d
        return n

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def mismatch(self, other: KVLayout) -> str | None:
        """A human-readable reason the two layouts cannot exchange blocks, or None."""
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k}: {mine[k]!r} != {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]
        if not diffs:
            return None
        why = "KV layout mismatch (" + ", ".join(diffs) + ")"
        if self.tp_size != other.tp_size:
            # NOTE: refused, not converted: each rank's pool holds its own KV heads, and
            # regrouping heads across ranks is not built.
            why += (
                f": the two pools split KV heads over different tensor-parallel sizes "
                f"({self.tp_size} and {other.tp_size}); hand off only between workers of "
                "the same tensor_parallel_size"
            )
        return why

    @staticmethod
    def dtype_name(dtype: torch.dtype) -> str:
        for name, value in _DTYPES.items():
            if value == dtype:
                return name
        raise ValueError(f"unsupported KV dtype {dtype}")
