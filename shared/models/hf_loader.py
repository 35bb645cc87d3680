"""A Hugging Face model folder: config.json + *.safetensors (+ tokenizer files)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError

from tokenyard.models.config import ModelConfig
from tokenyard.models.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

# NOTE: torch is imported only where weights are read: the gateway and router load tokenizers and model
# ids from here, and importing torch would cost each about 200 MiB of resident memory.

# config.json "model_type" -> our architecture name
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
}


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{str(folder)!r} is not a model folder: it has no config.json")
    try:
        raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{str(path)!r}: unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    try:
        return _config(raw, SUPPORTED_MODEL_TYPES[model_type])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{str(path)!r}: missing or bad field {e}") from e


def _config(raw: dict[str, Any], arch: str) -> ModelConfig:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    # transformers >= 5 writes rope settings as rope_parameters, older versions as rope_theta/rope_scaling
    rope = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        attention_bias=bool(
            raw.get("attention_bias", raw.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))
        ),
        **_moe_fields(raw),
    )


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Mixtral calls the expert count num_local_experts, Qwen2-MoE num_experts."""
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
    if not experts:
        return {}
    return {
        "num_local_experts": experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size") or 0),
        "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
        "moe_layer_step": int(raw.get("decoder_sparse_step") or 1),
        "dense_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
    }


def read_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(folder)!r} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {str(file)!r}: {e}") from e
        for name, tensor in tensors.items():
            weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    elif "lm_head.weight" not in weights:
        raise ModelLoadError(
            f"{str(folder)!r}: config says untied embeddings but there is no lm_head.weight"
        )
    if "model.embed_tokens.weight" not in weights:
        raise ModelLoadError(
            f"{str(folder)!r}: no model.embed_tokens.weight in the safetensors files"
        )
    return weights
