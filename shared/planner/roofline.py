"""Step times from the roofline: a decode step reads every weight it touches and every
cached token of its batch once (bandwidth-bound at small batch, compute-bound at large); a
prefill computes two FLOPs per active parameter per token plus attention (compute-bound).
Each term is the datasheet figure times an efficiency, and every step pays a fixed cost
(scheduling, kernel launches, sampling) that the roofline does not see.

All functions are pure and cheap: the simulator calls them for every engine step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenyard.planner.catalog import DTYPE_BYTES, Hardware, ModelSpec


@dataclass(frozen=True)
class Deployment:
    """One replica: a model on `tp x pp` accelerators of one kind, with its dtypes."""

    model: ModelSpec
    hw: Hardware
    tp: int = 1
    pp: int = 1
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def weight_bytes(self) -> float:
        return self.model.total_params * DTYPE_BYTES[self.weights_dtype]

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_elems_per_token * DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_shards(self) -> int:
        """Ranks the KV cache splits over: KV heads split across TP ranks up to their count
        (past it, ranks hold copies); pipeline stages split the layers."""
        heads = self.model.kv_heads if not self.model.kv_elems_per_layer else 1
        return min(self.tp, max(heads, 1)) * self.pp

    # --- memory ---------------------------------------------------------------------------

    def memory_per_gpu(self) -> dict[str, float]:
        """Bytes per accelerator: weights, buffers, and what is left for the KV cache."""
        usable = self.hw.memory_gb * 1e9 * self.hw.memory_utilization
        weights = self.weight_bytes / self.gpus
        buffers = self.hw.memory_gb * 1e9 * self.hw.buffer_fraction
        return {"weights": weights, "buffers": buffers, "kv": max(0.0, usable - weights - buffers)}

    def kv_capacity_tokens(self) -> int:
        per_token_per_gpu = self.kv_bytes_per_token / self.kv_shards
        return int(self.memory_per_gpu()["kv"] / per_token_per_gpu)

    # --- time -----------------------------------------------------------------------------

    def _allreduce_s(self, tokens: int) -> float:
        """Two all-reduces per layer (attention and MLP outputs), ring algorithm."""
        if self.tp == 1:
            return 0.0
        size = tokens * self.model.hidden * 2.0  # bf16 activations
        ring = 2.0 * (self.tp - 1) / self.tp * size / (self.hw.link_gbs * 1e9)
        per_layer = 2 * (ring + self.hw.allreduce_latency_us * 1e-6)
        return per_layer * self.model.layers  # the stages' layers run one after another

    def decode_step_s(self, batch: int, context: float) -> float:
        """One decode step of `batch` sequences whose mean length so far is `context`."""
        if batch <= 0:
            return 0.0
        m = self.model
        small = batch <= self.hw.small_batch_rows
        read = m.params_touched(batch) * DTYPE_BYTES[self._read_dtype(small)]
        read += batch * context * self.kv_bytes_per_token
        # pp stages run one after another for one token: the replica's whole read, in turn.
        mem_s = read / self.tp / (self.hw.bandwidth_gbs * 1e9 * self.hw.decode_bw_eff)
        eff = self.hw.small_batch_flops_eff if small else self.hw.decode_flops_eff
        compute_s = self.decode_compute_s(batch, context, eff)
        # A widening kernel's floor and the rows' own work add up: widening every weight
        # costs the same at any row count, and each row's products, attention and norms
        # come on top of it (see _widen_s).
        busy_s = self._widen_s(batch, small) + compute_s  # no widening kernel: a floor of 0
        return self.hw.step_overhead_ms * 1e-3 + max(mem_s, busy_s) + self._allreduce_s(batch)

    def decode_compute_s(self, batch: int, context: float, eff: float = 1.0) -> float:
        """A decode step's arithmetic at `eff` of the hardware's matmul rate."""
        m = self.model
        flops = (
            2.0 * m.active_params * batch + 4.0 * m.layers * context * m.heads * m.head_dim * batch
        )
        return flops / self.tp / (self.hw.flops(self.weights_dtype) * eff)

    def _widen_s(self, rows: int, small: bool) -> float:
        """The floor a widening kernel puts under a step above the small-batch rows."""
        if small or not self.hw.widen_gbs:
            return 0.0
        weights = self.model.params_touched(rows) * DTYPE_BYTES[self.weights_dtype]
        return weights / self.tp / (self.hw.widen_gbs * 1e9)

    def _read_dtype(self, small: bool) -> str:
        """The weights a step reads: a CPU engine's larger steps read the dense copy."""
        if self.hw.small_batch_rows and not small and self.hw.dense_dtype:
            return self.hw.dense_dtype
        return self.weights_dtype

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """One prompt's prefill (its uncached part) alone on the replica."""
        if new_tokens <= 0:
            return self.hw.step_overhead_ms * 1e-3
        m = self.model
        # Attention: each new token attends to every earlier one (causal), cached included.
        span = cached_tokens * new_tokens + new_tokens * (new_tokens + 1) / 2
        flops = 2.0 * m.active_params * new_tokens + 4.0 * m.layers * m.heads * m.head_dim * span
        peak = self.hw.flops(self.weights_dtype) * self.hw.prefill_flops_eff
        compute_s = flops / self.tp / peak
        small = new_tokens <= self.hw.small_batch_rows
        read = m.params_touched(new_tokens) * DTYPE_BYTES[self._read_dtype(small)]
        mem_s = read / self.tp / (self.hw.bandwidth_gbs * 1e9 * self.hw.decode_bw_eff)
        mem_s = max(mem_s, self._widen_s(new_tokens, small))
        return (
            self.hw.step_overhead_ms * 1e-3 + max(compute_s, mem_s) + self._allreduce_s(new_tokens)
        )

    def prefill_tokens_per_s(self, prompt_len: int, cached_tokens: int = 0) -> float:
        new = max(prompt_len - cached_tokens, 1)
        return new / self.prefill_s(new, cached_tokens)

    def kv_transfer_s(self, tokens: int, network_gbs: float) -> float:
        """Moving one prompt's KV cache from a prefill replica to a decode replica."""
        if network_gbs <= 0 or math.isinf(network_gbs):
            return 0.0
        return tokens * self.kv_bytes_per_token / (network_gbs * 1e9)
