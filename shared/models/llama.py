"""Llama-family decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Other families are small variations (Qwen2: q/k/v biases; Mistral: same as Llama; Mixtral
and Qwen2-MoE: sparse expert layers from tokenyard.models.moe in place of the MLP) and reuse
this file through ModelConfig flags. q/k/v and gate/up are fused into one matmul
each: fewer, larger matmuls cost less per step on a CPU.
"""

from __future__ import annotations

import math
import os
from typing import cast

import torch
from torch import nn

from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.models.attention import AttnMetadata, paged_attention
from tokenyard.models.config import ModelConfig
from tokenyard.models.fused import add_rms_norm, rotary_
from tokenyard.models.lora import LoRABatch, base_layer
from tokenyard.models.mlp import MLP
from tokenyard.models.module import LeanModule
from tokenyard.models.moe import SparseMoeBlock
from tokenyard.models.quantize import QuantizedLinear, fp32_linear, project


class RMSNorm(LeanModule):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add rides along with the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """HF's rotate-half RoPE with a precomputed cos/sin table over every position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        inv_freq = _scale_inv_freq(inv_freq, config.rope_scaling)
        t = torch.arange(max_positions, dtype=torch.float64)
        if (
            config.rope_scaling
            and config.rope_scaling.get("rope_type", config.rope_scaling.get("type")) == "linear"
        ):
            t = t / float(config.rope_scaling["factor"])
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # NOTE: plain attributes, not buffers: the tables stay fp32 when the model is cast.
        self.cos = emb.cos().float()  # [max_pos, head_dim]
        self.sin = emb.sin().float()

    def apply_(self, qkv: torch.Tensor, positions: torch.Tensor, num_heads: int) -> None:
        """Rotate the first `num_heads` heads of each row of a fused q/k/v output, in place."""
        rotary_(qkv, positions, self.cos, self.sin, num_heads, self.cos.shape[1])


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    """Frequency-dependent RoPE scaling: a GGUF's per-pair divisors (`freq_factors`, read
    from llama.cpp's rope_freqs.weight) or Llama 3's rope_scaling, which yields the same
    divisors from four numbers; other kinds leave inv_freq as is."""
    if scaling and "freq_factors" in scaling:
        factors = torch.tensor(scaling["freq_factors"], dtype=inv_freq.dtype)
        assert factors.shape == inv_freq.shape, (factors.shape, inv_freq.shape)
        return inv_freq / factors
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = (
        float(scaling.get("low_freq_factor", 1.0)),
        float(scaling.get("high_freq_factor", 4.0)),
    )
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


class Attention(LeanModule):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.split = (q_size, kv_size, kv_size)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttnMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = project(self.qkv_proj, x, meta.prompt_step)
        rope.apply_(
            qkv, positions, self.num_heads + self.num_kv_heads
        )  # q and k heads lie side by side
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # kv_cache: [num_blocks, num_layers, 2, block_size, H_kv, D]; this layer's view.
        o = paged_attention(q, k, v, kv_cache[:, self.layer_idx], meta, self.scale)
        return project(self.o_proj, o.reshape(t, self.num_heads * self.head_dim), meta.prompt_step)


class DecoderLayer(LeanModule):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = (
            SparseMoeBlock(config)
            if config.is_moe_layer(layer_idx)
            else MLP(config.hidden_size, config.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttnMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (None: x is it)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta.prompt_step), residual


_NO_ROWS = torch.empty(0, dtype=torch.long)
_NO_BIAS = torch.empty(0)


class LlamaForCausalLM(LeanModule):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.max_positions = max_positions
        self.rope: RotaryEmbedding | None = None  # built by load_weights (never on "meta")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.requires_grad_(False)
        # Steps on a CPU run every layer in one call of the kernels' decoder_layers where
        # each layer can (`_fused_plan`); False (or TOKENYARD_FUSED_LAYERS=0): always layer
        # by layer (the twin).
        self.fused_layers = os.environ.get("TOKENYARD_FUSED_LAYERS", "1") not in (
            "0",
            "false",
            "no",
        )
        self._fused_plans: dict[tuple[int, bool], tuple[list[torch.Tensor], list[int]] | None] = {}
        # Set by models.lora.apply_lora: the step's rows by adapter, filled by the runner.
        self.lora_batch: LoRABatch | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden]."""
        # The table may be narrower than the compute dtype (engine.memory.compact_embeddings).
        x = self.embed_tokens(input_ids).to(self.norm.weight.dtype)
        assert self.rope is not None, "load_weights() first"
        plan = self._fused_plan(x, kv_cache, meta.prompt_step)
        if plan is not None:
            kernels, (weights, kinds) = cpu_kernels.ops(), plan
            assert kernels is not None
            attn = cast(DecoderLayer, self.layers[0]).self_attn
            split = meta.cpu_split(
                kv_cache.dtype, (attn.num_heads, attn.num_kv_heads, kv_cache.shape[-1])
            )
            return kernels.decoder_layers(
                x,
                positions,
                self.rope.cos,
                self.rope.sin,
                kv_cache,
                meta.slot_blocks,
                meta.slot_offsets,
                split.tables,
                split.lens,
                _NO_ROWS if split.rows is None else split.rows,
                [s.block_ids for s in split.spans],
                [n for s in split.spans for n in (s.start, s.num_tokens, s.context_len)],
                weights,
                kinds,
                attn.num_heads,
                attn.num_kv_heads,
                attn.scale,
                self.norm.eps,
            )
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, meta, kv_cache)
        return self.norm(x, residual)[0]

    def _fused_plan(
        self, x: torch.Tensor, kv_cache: torch.Tensor, prompt: bool
    ) -> tuple[list[torch.Tensor], list[int]] | None:
        """What the kernels' `decoder_layers` takes for this step (every layer's weights
        and its projections' kernels), or None: the layers run one by one. It runs any step
        on a CPU with the kernels built where every layer is a dense Llama layer (Qwen2's
        q/k/v biases included: the kernel adds them after the projection, as the twin does)
        whose four projections each run one of the C++ kernels at this step's size
        (QuantizedLinear.step_kernel): the default int4 and int8 weights on x86 (a prompt
        step's dense copy on CPUs without AMX runs in oneDNN: there the layers run one by
        one). Plans are kept per (rows, prompt step)."""
        if not self.fused_layers:
            return None
        if self.lora_batch is not None and self.lora_batch.groups:
            return None  # adapter rows: the layers' LoRA products run layer by layer
        if x.device.type != "cpu" or kv_cache.dim() != 6 or cpu_kernels.ops() is None:
            return None
        key = (x.shape[0], prompt)
        if key not in self._fused_plans:
            self._fused_plans[key] = self._build_fused_plan(*key)
        return self._fused_plans[key]

    def _build_fused_plan(
        self, rows: int, prompt: bool
    ) -> tuple[list[torch.Tensor], list[int]] | None:
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        for layer in self.layers:
            if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, MLP):
                return None
            attn = layer.self_attn
            if not isinstance(attn, Attention):
                return None
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for lora_proj in (
                attn.qkv_proj,
                attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                proj = base_layer(lora_proj)
                if not isinstance(proj, QuantizedLinear):
                    return None
                kernel = proj.step_kernel(rows, prompt)
                if kernel is None:
                    return None
                kinds.append(kernel[0])
                weights += [*kernel[1], _NO_BIAS if proj.bias is None else proj.bias]
        return weights + [self.norm.weight], kinds

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> fp32 logits [T, vocab]."""
        return fp32_linear(self.lm_head, hidden)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights, fusing q/k/v and gate/up into this model's fused layers."""
        self.rope = RotaryEmbedding(self.config, self.max_positions)
        self._fused_plans.clear()  # plans hold the weights they were built from
        self.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        self.norm.weight.copy_(weights["model.norm.weight"])
        if "lm_head.weight" in weights and not self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(weights["lm_head.weight"])
        else:
            self.lm_head.weight = self.embed_tokens.weight  # tied: one tensor, read once
        for i in range(len(self.layers)):
            layer = cast(DecoderLayer, self.layers[i])
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(weights[p + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(
                weights[p + "post_attention_layernorm.weight"]
            )
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(
                torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            )
            if attn.qkv_proj.bias is not None:
                attn.qkv_proj.bias.copy_(
                    torch.cat([weights[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
                )
            attn.o_proj.weight.copy_(weights[p + "self_attn.o_proj.weight"])
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.load_weights(weights, p)
            else:
                layer.mlp.load(
                    *(weights[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
                )
