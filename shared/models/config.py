"""The shape of a model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "qwen2", "mistral", "mixtral", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # qwen2 has q/k/v biases
    num_local_experts: int = 0  # > 0 for a Mixtral-style MoE
    num_experts_per_tok: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
