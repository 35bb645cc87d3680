"""Engine settings: what model, what precision, how the KV pool and the step budget are sized."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenyard.engine.spec.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from tokenyard.kv.layout import KVLayout


@dataclass
class EngineConfig:
    model: str | None = None  # a .gguf file or an HF folder; None = the default model
    dtype: str = "float32"  # weights and activations: float32 | bfloat16
    quantization: str | None = (
        None  # None | "int8" | "int4" (weight-only; tokenyard.models.quantize)
    )
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # the per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None = the model's context length, capped at 8192
    kv_cache_bytes: int = 512 * 1024**2  # the KV pool's memory budget
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None = leave torch's default
    # Makes the KV pool: (layout, num_blocks) -> a zeroed contiguous tensor of
    # layout.pool_shape(num_blocks). None = private memory; workers pass a shared-memory
    # allocator so a peer on the same host can read blocks without a copy through a socket.
    kv_pool_factory: Callable[[KVLayout, int], torch.Tensor] | None = None
    # Speculative decoding, in vLLM's keys: {"method": "ngram", "num_speculative_tokens": 4}
    # or {"method": "draft", "model": None, "quantization": "int4"} (tokenyard.engine.spec).
    # A dict or its JSON text is parsed into a SpeculativeConfig here.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(
                f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
