"""Builds the model and the KV pool, and accounts for serving memory's three tenants:
weights, KV cache, and buffers (RoPE tables and the step's activation workspace)."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from tokenyard.engine.config import EngineConfig
from tokenyard.kv.layout import KVLayout
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.loader import LoadedModel
from tokenyard.models.quantize import QuantizedLinear, quantize

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass
class MemoryReport:
    weights_bytes: int
    kv_cache_bytes: int
    buffers_bytes: int  # RoPE tables + an estimate of the largest step's activations
    num_blocks: int
    block_nbytes: int
    # Weight bytes one batch-1 decode step reads: every projection (its quantized copy where
    # there is one), the norms, and one embedding row. Memory bandwidth over this is the
    # ceiling on single-sequence decode speed.
    decode_read_bytes: int = 0

    def describe(self) -> str:
        mib = 1024**2
        return (
            f"weights {self.weights_bytes / mib:.1f} MiB, KV cache {self.kv_cache_bytes / mib:.1f} MiB "
            f"({self.num_blocks} blocks x {self.block_nbytes / 1024:.0f} KiB), "
            f"buffers {self.buffers_bytes / mib:.1f} MiB"
        )


def build_model_and_pool(
    loaded: LoadedModel, config: EngineConfig
) -> tuple[LlamaForCausalLM, torch.Tensor, KVLayout, MemoryReport]:
    mc = loaded.config
    if mc.architecture not in SUPPORTED_ARCHITECTURES or mc.num_local_experts:
        raise ValueError(f"unsupported model architecture {mc.architecture!r}")
    dtype = _DTYPES[config.dtype]
    max_positions = min(
        config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
    )
    with torch.device("meta"):  # no time spent initialising weights we overwrite anyway
        model = LlamaForCausalLM(mc, max_positions)
    model.to_empty(device="cpu")
    model.load_weights(loaded.weights)
    model.to(dtype)
    if config.quantization:
        quantize(model, config.quantization)
    layout = KVLayout(
        model_id=loaded.model_id,
        dtype=config.dtype,
        block_size=config.block_size,
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
    )
    num_blocks = config.kv_cache_bytes // layout.block_nbytes
    if num_blocks < 2:
        raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds fewer than 2 KV blocks")
    if config.kv_pool_factory is None:
        kv_cache = zeroed_pool(layout.pool_shape(num_blocks), dtype)
    else:
        kv_cache = config.kv_pool_factory(layout, num_blocks)
        assert kv_cache.shape == layout.pool_shape(num_blocks) and kv_cache.dtype == dtype
        assert kv_cache.is_contiguous()
    report = MemoryReport(
        weights_bytes=_weights_bytes(model),
        kv_cache_bytes=kv_cache.numel() * kv_cache.element_size(),
        buffers_bytes=_buffers_bytes(model, config, dtype),
        num_blocks=num_blocks,
        block_nbytes=layout.block_nbytes,
        decode_read_bytes=_decode_read_bytes(model),
    )
    return model, kv_cache, layout, report


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in anonymous memory that becomes resident page by page as it is
    written (torch.zeros writes every page up front: a large KV pool would count whole in
    RSS before its first request)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def _weights_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()  # tied embeddings: one tensor, counted once
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _decode_read_bytes(model: LlamaForCausalLM) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.quantized_bytes()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, torch.nn.Embedding):
            total += module.weight.shape[1] * module.weight.element_size()
        elif not list(module.children()):  # norms
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def _buffers_bytes(model: LlamaForCausalLM, config: EngineConfig, dtype: torch.dtype) -> int:
    assert model.rope is not None
    rope = 2 * model.rope.cos.numel() * model.rope.cos.element_size()
    mc = model.config
    t = config.max_num_batched_tokens
    # per row: residual + normed + qkv + attention out + gate_up + activation, and fp32 logits
    per_row = (
        3 * mc.hidden_size
        + (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
        + mc.num_attention_heads * mc.head_dim
        + 3 * mc.intermediate_size
    )
    activations = t * per_row * dtype.itemsize + config.max_num_seqs * mc.vocab_size * 4
    return rope + activations
