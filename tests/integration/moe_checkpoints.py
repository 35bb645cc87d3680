"""Tiny random Mixture-of-Experts checkpoints built by transformers' own classes, saved as a
Hugging Face folder (safetensors + the default model's tokenizer) or converted to GGUF the
way llama.cpp names and lays out the tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tokenyard.models.gguf_file import GGUFFile
from tokenyard.models.loader import default_model_path, load_tokenizer

VOCAB = 49152  # the default tokenizer's, so the folders can reuse it


def hf_moe_model(kind: str, **overrides):
    """A tiny randomly initialized MixtralForCausalLM or Qwen2MoeForCausalLM (fp32, eval)."""
    import transformers

    common: dict[str, Any] = (
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            initializer_range=0.2,  # logits that differ: at 0.02 every token is about as likely
        )
        | overrides
    )
    if kind == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4)
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
        cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # decisive routing: a random router at init scale gives near-ties between experts,
            # where float noise, not the implementation, would pick the expert
            if name.endswith(".gate.weight") and p.shape[0] == 4:  # [num_experts, hidden]
                p.normal_(0.0, 1.0)
    return model


def save_hf_folder(model, folder: Path) -> Path:
    model.save_pretrained(str(folder))
    tokenizer = load_tokenizer()
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token})
    )
    return folder


def save_gguf(folder: Path, path: Path) -> Path:
    """Convert a saved HF folder (Mixtral or Qwen2-MoE) to an F32 GGUF file."""
    config = json.loads((folder / "config.json").read_text())
    weights = {
        k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    mixtral = config["model_type"] == "mixtral"
    arch = "llama" if mixtral else "qwen2moe"
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if not mixtral:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    _copy_tokenizer(writer)
    writer.add_tensor("token_embd.weight", weights.pop("model.embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", weights.pop("model.norm.weight"))
    writer.add_tensor("output.weight", weights.pop("lm_head.weight"))
    for i in range(config["num_hidden_layers"]):
        for name, tensor in _layer_tensors(weights, i, mixtral, heads, kv_heads, config):
            writer.add_tensor(f"blk.{i}.{name}", np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _layer_tensors(w, i, mixtral, heads, kv_heads, config):
    p = f"model.layers.{i}."
    yield "attn_norm.weight", w[p + "input_layernorm.weight"]
    yield "ffn_norm.weight", w[p + "post_attention_layernorm.weight"]
    for n, gg in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        t = w[f"{p}self_attn.{n}_proj.weight"]
        if mixtral and n in "qk":  # llama.cpp interleaves RoPE pairs for the llama family
            t = _llama_cpp_permute(t, heads if n == "q" else kv_heads)
        yield f"{gg}.weight", t
        if f"{p}self_attn.{n}_proj.bias" in w:
            yield f"{gg}.bias", w[f"{p}self_attn.{n}_proj.bias"]
    experts = config.get("num_local_experts") or config["num_experts"]
    if mixtral:
        q = p + "block_sparse_moe."
        yield "ffn_gate_inp.weight", w[q + "gate.weight"]
        for gg, n in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            yield (
                f"{gg}.weight",
                np.stack([w[f"{q}experts.{e}.{n}.weight"] for e in range(experts)]),
            )
        return
    q = p + "mlp."
    yield "ffn_gate_inp.weight", w[q + "gate.weight"]
    for n in ("gate", "up", "down"):
        stacked = np.stack([w[f"{q}experts.{e}.{n}_proj.weight"] for e in range(experts)])
        yield f"ffn_{n}_exps.weight", stacked
        yield f"ffn_{n}_shexp.weight", w[f"{q}shared_expert.{n}_proj.weight"]
    yield "ffn_gate_inp_shexp.weight", w[q + "shared_expert_gate.weight"].reshape(-1)


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The default model's tokenizer metadata, key for key."""
    with GGUFFile(default_model_path()) as source:
        for key, value in source.metadata.items():
            if not key.startswith("tokenizer."):
                continue
            if isinstance(value, list):
                writer.add_array(key, value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            elif isinstance(value, int):
                writer.add_uint32(key, value)
            else:
                writer.add_string(key, str(value))
