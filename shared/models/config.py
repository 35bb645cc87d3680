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
    num_local_experts: int = 0  # > 0 for a Mixture-of-Experts model (tokenyard.models.moe)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; 0 = intermediate_size (Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0 = none
    norm_topk_prob: bool = True  # renormalize the chosen experts' probabilities
    moe_layer_step: int = 1  # every n-th layer is sparse (Qwen2-MoE's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers kept dense (Qwen2-MoE's mlp_only_layers)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_local_experts and not self.moe_intermediate_size:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_local_experts > 0
            and i not in self.dense_layers
            and (i + 1) % self.moe_layer_step == 0
        )
