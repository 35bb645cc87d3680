"""GGUF -> (ModelConfig, Hugging Face-named float weights, tokenizer spec).

llama.cpp names tensors `blk.{i}.attn_q.weight` and, for the llama family, stores the
q/k rows permuted for its interleaved RoPE; the engine uses Hugging Face names and
rotate-half RoPE, so both are undone here.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tokenyard.models.config import ModelConfig
from tokenyard.models.errors import ModelLoadError
from tokenyard.models.gguf_file import GGUFFile, TensorInfo

if TYPE_CHECKING:
    import torch

# NOTE: torch is imported only where weights are read: the gateway and router load tokenizers and model
# ids from here, and importing torch would cost each about 200 MiB of resident memory.

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen2moe")
# llama.cpp's converter permutes q/k for these (their HF checkpoints use rotate-half RoPE).
_PERMUTED_QK = ("llama", "mistral")
_DEQUANT_THREADS = 4

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
# Experts are stacked in one tensor: [num_experts, rows, cols]. Mixtral (a llama file with
# experts) and Qwen2-MoE name them differently in Hugging Face checkpoints.
_EXPERT_NAMES = {
    "mixtral": {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"},
    "qwen2_moe": {
        "ffn_gate_exps": "gate_proj",
        "ffn_down_exps": "down_proj",
        "ffn_up_exps": "up_proj",
    },
}
_EXPERTS_PREFIX = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp"}
_QWEN2_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Not a weight: llama.cpp's converter writes Llama 3's rope scaling as this tensor of
# per-dimension frequency divisors, which read_config puts into config.rope_scaling.
ROPE_FREQS = "rope_freqs.weight"
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_QUANT_SUFFIX_RE = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16|fp16|fp32)$", re.IGNORECASE)


def read_config(gguf: GGUFFile) -> ModelConfig:
    md = gguf.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path!r}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(name: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{gguf.path!r}: metadata key {arch}.{name} is missing")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // heads)))
    num_experts = int(key("expert_count", 0))
    architecture = "qwen2_moe" if arch == "qwen2moe" else "mixtral" if num_experts else arch
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(key("vocab_size", len(md.get("tokenizer.ggml.tokens", ())) or None)),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        rope_scaling=_rope_scaling(gguf, arch, head_dim),
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        num_local_experts=num_experts,
        num_experts_per_tok=int(key("expert_used_count", 0)),
        moe_intermediate_size=int(key("expert_feed_forward_length", 0)),
        shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
        # llama.cpp renormalizes Mixtral's top-k weights and not Qwen2-MoE's
        norm_topk_prob=bool(key("expert_weights_norm", architecture == "mixtral")),
    )


def _rope_scaling(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any] | None:
    """The metadata's scaling kind (linear, yarn, ...) and the rope_freqs tensor's factors,
    as tokenyard.models.llama.RotaryEmbedding reads them (both, where a file has both)."""
    md = gguf.metadata
    kind = md.get(f"{arch}.rope.scaling.type")
    scaling: dict[str, Any] = {}
    if kind not in (None, "none"):
        scaling["rope_type"] = kind
        scaling["factor"] = float(md.get(f"{arch}.rope.scaling.factor", 1.0))
        original = md.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
    if ROPE_FREQS in gguf.tensors:
        scaling.setdefault("rope_type", "freq_factors")
        scaling["freq_factors"] = _freq_factors(gguf, head_dim)
    return scaling or None


def _freq_factors(gguf: GGUFFile, head_dim: int) -> tuple[float, ...]:
    """rope_freqs.weight: one divisor per rotated pair of dimensions (llama.cpp's
    freq_factors; for Llama 3, `factor` for low frequencies, 1 for high ones, smoothly
    between). The engine rotates whole heads, so there must be head_dim / 2 of them."""
    info = gguf.tensors[ROPE_FREQS]
    factors = tuple(float(f) for f in _dequantize(gguf, info).reshape(-1))
    if len(factors) != head_dim // 2:
        raise ModelLoadError(
            f"{gguf.path!r}: {ROPE_FREQS} holds {len(factors)} factors; a head of "
            f"{head_dim} dimensions rotates {head_dim // 2} pairs"
        )
    return factors


def model_id(gguf: GGUFFile) -> str:
    """The file name without its quantization suffix, else general.basename-size_label."""
    stem = _QUANT_SUFFIX_RE.sub("", Path(gguf.path).name.removesuffix(".gguf"))
    if stem and stem.lower() not in ("model", "ggml-model"):
        return stem
    md = gguf.metadata
    parts = [md.get("general.basename") or md.get("general.name"), md.get("general.size_label")]
    return "-".join(str(p) for p in parts if p) or stem or "model"


def read_weights(
    gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """All tensors, dequantized, renamed to Hugging Face Llama names, q/k un-permuted."""
    import torch

    infos = [info for name, info in gguf.tensors.items() if name != ROPE_FREQS]
    for info in infos:
        _check_supported(gguf, info)
    # NOTE: numpy releases the GIL in dequantize's array ops, so threads roughly halve the time.
    with ThreadPoolExecutor(_DEQUANT_THREADS) as pool:
        arrays = list(pool.map(lambda info: _dequantize(gguf, info), infos))
    weights: dict[str, torch.Tensor] = {}
    for info, array in zip(infos, arrays, strict=True):
        tensor = torch.from_numpy(array)
        for name, part in _hf_tensors(gguf.path, info.name, tensor, config.architecture):
            weights[name] = _fix_layout(name, part, config).to(dtype).contiguous()
    return weights


def _check_supported(gguf: GGUFFile, info: TensorInfo) -> None:
    try:
        dequantize(
            np.zeros((1, GGML_QUANT_SIZES[info.ggml_type][1]), dtype=np.uint8), info.ggml_type
        )
    except NotImplementedError:
        raise ModelLoadError(
            f"{gguf.path!r}: tensor {info.name!r} uses {info.ggml_type.name}, which cannot be dequantized"
        ) from None


def _dequantize(gguf: GGUFFile, info: TensorInfo) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
    row_bytes = info.shape[-1] // block_size * type_size
    raw = gguf.raw(info).reshape(-1, row_bytes)
    return np.asarray(dequantize(raw, info.ggml_type), dtype=np.float32).reshape(info.shape)


def _hf_tensors(
    path: str, name: str, tensor: torch.Tensor, architecture: str
) -> list[tuple[str, torch.Tensor]]:
    if name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[name], tensor)]
    match = _LAYER_RE.match(name)
    if match is None:
        raise ModelLoadError(f"{path!r}: unexpected tensor {name!r}")
    layer, kind, suffix = match.groups()
    prefix = f"model.layers.{layer}"
    experts = _EXPERT_NAMES.get(architecture, {})
    if kind in experts:
        # tensor: [num_experts, out_features, in_features]
        p = f"{prefix}.{_EXPERTS_PREFIX[architecture]}.experts"
        return [(f"{p}.{e}.{experts[kind]}.{suffix}", t) for e, t in enumerate(tensor)]
    if architecture == "qwen2_moe" and kind in _QWEN2_MOE_NAMES:
        if kind == "ffn_gate_inp_shexp":
            tensor = tensor.reshape(1, -1)  # llama.cpp keeps the one-row gate as a vector
        return [(f"{prefix}.{_QWEN2_MOE_NAMES[kind]}.{suffix}", tensor)]
    if kind not in _LAYER_NAMES:
        raise ModelLoadError(f"{path!r}: unexpected tensor {name!r}")
    return [(f"{prefix}.{_LAYER_NAMES[kind]}.{suffix}", tensor)]


def _fix_layout(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if config.architecture not in (*_PERMUTED_QK, "mixtral"):
        return tensor
    if ".self_attn.q_proj." in name:
        return unpermute_qk(tensor, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_qk(tensor, config.num_key_value_heads)
    return tensor


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Per head, llama.cpp orders the rows as interleaved pairs (x0, x_half, x1, x_half+1, ...);
    Hugging Face keeps the first half then the second half:

        gguf rows of one head: [n_heads, head_dim // 2, 2, ...]  ->  hf: [n_heads, 2, head_dim // 2, ...]
    """
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )
