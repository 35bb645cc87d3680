"""Engine settings: what model, what precision, how the KV pool and the step budget are sized."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tokenyard.kv.layout import KVLayout


@dataclass
class EngineConfig:
    model: str | None = None  # a .gguf file or an HF folder; None = the default model
    dtype: str = "float32"  # weights and activations: float32 | bfloat16
    # None | "int8" | "int4" | "fp8" (weight-only; tokenyard.models.quantize)
    quantization: str | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None = the model's context length, capped at 8192
    kv_cache_bytes: int = 512 * 1024**2  # the KV pool's memory budget
    enable_prefix_caching: bool = True
    # Batch-invariant steps: a request's tokens do not depend on its batch neighbours, prefix
    # cache hits, chunking, preemption or a prefill-to-decode hand-off. Every row runs the
    # same kernels whatever the step's shape: the quantized kernel at any row count (no
    # dense copy) and the per-query decode attention for prompt tokens too. Needs int8 or
    # int4, whose kernels compute each row on its own (docs/precision.md has the cost).
    deterministic: bool = False
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    # Makes the KV pool: (layout, num_blocks) -> a zeroed contiguous tensor of
    # layout.pool_shape(num_blocks). None = private memory; workers pass a shared-memory
    # allocator so a peer on the same host can read blocks without a copy through a socket.
    kv_pool_factory: Callable[[KVLayout, int], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "int8", "int4", "fp8"):
            raise ValueError(
                f"quantization must be None, 'int8', 'int4' or 'fp8', got {self.quantization!r}"
            )
        if self.deterministic and self.quantization not in ("int8", "int4"):
            raise ValueError(
                "deterministic mode needs quantization 'int8' or 'int4' (their kernels compute "
                f"each row on its own; dense matmuls do not promise that), got {self.quantization!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
