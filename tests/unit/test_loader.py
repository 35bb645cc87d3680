"""Model loading: GGUF (the default SmolLM2 file and synthetic ones) and HF folders."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from tokenyard.models.loader import (
    ModelLoadError,
    default_model_path,
    load_model,
    load_tokenizer,
    model_id_of,
)

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def default_model(loaded_model):
    """load_model()'s result: the session's (tests/conftest.py), loaded once for the suite.
    These tests only read it."""
    return loaded_model


def test_default_model_path_is_the_packaged_gguf():
    path = default_model_path()
    assert path.endswith(".gguf")
    assert Path(path).is_file()


def test_default_config(default_model):
    c = default_model.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.rope_theta == 100000.0
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings is True
    assert c.rope_scaling is None
    assert default_model.model_id == "SmolLM2-135M-Instruct" == model_id_of(None)


def test_default_weight_names_and_shapes(default_model):
    w = default_model.weights
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.input_layernorm.weight": (576,),
            f"{p}.post_attention_layernorm.weight": (576,),
            f"{p}.self_attn.q_proj.weight": (576, 576),
            f"{p}.self_attn.k_proj.weight": (192, 576),
            f"{p}.self_attn.v_proj.weight": (192, 576),
            f"{p}.self_attn.o_proj.weight": (576, 576),
            f"{p}.mlp.gate_proj.weight": (1536, 576),
            f"{p}.mlp.up_proj.weight": (1536, 576),
            f"{p}.mlp.down_proj.weight": (576, 1536),
        }
    assert {k: tuple(v.shape) for k, v in w.items()} == expected
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in w.values())
    assert all(torch.isfinite(v).all() for v in w.values())


def test_dtype_is_applied():
    model = load_model(dtype=torch.bfloat16)
    assert {v.dtype for v in model.weights.values()} == {torch.bfloat16}


def test_load_tokenizer_is_cheap():
    start = time.perf_counter()
    tokenizer = load_tokenizer()
    elapsed = time.perf_counter() - start
    print(f"\nload_tokenizer(default) took {elapsed:.2f} s")
    assert tokenizer.encode("<|im_start|>") == [1]


@pytest.mark.slow
def test_default_weights_equal_transformers_gguf_load(default_model):
    import transformers

    path = Path(default_model_path())
    start = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    print(f"\ntransformers GGUF load took {time.perf_counter() - start:.2f} s")
    reference = hf.state_dict()
    ours = default_model.weights
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: no separate lm_head
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name].float(), atol=1e-6, rtol=0, msg=name)


# -- HF safetensors folders ----------------------------------------------------------


def _save_tiny_hf_model(folder: Path, *, tie: bool) -> dict[str, torch.Tensor]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(folder))
    source = load_tokenizer()
    source.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": source.bos_token,
                "eos_token": {"content": source.eos_token},
                "chat_template": source.chat_template,
            }
        )
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tie", [True, False])
def test_hf_folder_loads_identical_tensors(tmp_path, tie):
    folder = tmp_path / "tiny-llama"
    reference = _save_tiny_hf_model(folder, tie=tie)
    model = load_model(str(folder))
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        64,
        2,
        4,
        2,
    )
    assert (c.head_dim, c.rope_theta, c.tie_word_embeddings) == (16, 50000.0, tie)
    assert model.model_id == "tiny-llama"
    expected = {k: v for k, v in reference.items() if not (tie and k == "lm_head.weight")}
    assert set(model.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(model.weights[name], tensor), name


def test_hf_folder_tokenizer_matches_gguf_tokenizer(tmp_path):
    folder = tmp_path / "tiny-llama"
    _save_tiny_hf_model(folder, tie=True)
    ours, source = load_tokenizer(str(folder)), load_tokenizer()
    text = "<|im_start|>user\nHéllo wörld 你好 🤗\t  x = 1<|im_end|>"
    assert ours.encode(text) == source.encode(text)
    assert ours.eos_token_ids == source.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == source.apply_chat_template(messages)


# -- synthetic GGUF files: every dequantization path and the q/k un-permutation -----

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# Per-tensor storage types; K-quants cannot be produced by the gguf package, so they get
# random blocks and are compared with gguf's own dequantization of the same bytes.
QUANT_TYPES = {
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.F16,
    "attn_output": Q.BF16,
    "ffn_gate": Q.Q4_1,
}
K_QUANT_TYPES = {"ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (interleaved RoPE pairs)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_tiny_gguf(path: Path, arch: str = "llama") -> dict[str, torch.Tensor]:
    """A 2-layer llama GGUF; returns the weights a correct loader must produce (HF names)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(c) for c in range(33, 33 + 250)] + [f"<ctl{i}>" for i in range(6)])
    writer.add_token_types([1] * 250 + [3] * 6)
    writer.add_bos_token_id(250)
    writer.add_eos_token_id(251)
    expected: dict[str, torch.Tensor] = {}

    def add(name: str, hf_name: str, w: np.ndarray, qtype: Q, permute_heads: int = 0) -> None:
        stored = _llama_cpp_permute(w, permute_heads) if permute_heads else w
        if qtype == Q.F32:
            writer.add_tensor(name, stored)
            expected[hf_name] = torch.from_numpy(w)
            return
        data = quantize(stored, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        # quantization works on whole rows, so un-permuting after it equals quantizing w itself
        expected[hf_name] = torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape))

    add(
        "token_embd.weight",
        "model.embed_tokens.weight",
        rng.standard_normal((256, HIDDEN), np.float32),
        Q.Q8_0,
    )
    add("output_norm.weight", "model.norm.weight", rng.standard_normal(HIDDEN, np.float32), Q.F32)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        hf = f"model.layers.{i}"
        add(
            f"blk.{i}.attn_norm.weight",
            f"{hf}.input_layernorm.weight",
            rng.standard_normal(HIDDEN, np.float32),
            Q.F32,
        )
        add(
            f"blk.{i}.ffn_norm.weight",
            f"{hf}.post_attention_layernorm.weight",
            np.ones(HIDDEN, np.float32),
            Q.F32,
        )
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN)}
        shapes |= {
            "attn_v": (KV_HEADS * head_dim, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (FFN, HIDDEN),
        }
        names = {
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
        }
        names |= {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj"}
        for kind, qtype in QUANT_TYPES.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(kind, 0)
            w = rng.standard_normal(shapes[kind], np.float32)
            add(
                f"blk.{i}.{kind}.weight",
                f"{hf}.{names[kind]}.weight",
                w,
                qtype,
                permute_heads=heads,
            )
        for kind, qtype in K_QUANT_TYPES.items():
            rows, cols = (FFN, HIDDEN) if kind == "ffn_up" else (HIDDEN, FFN)
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
            raw.reshape(rows, -1, size)[..., -2:] = (
                0  # keep each block's f16 scale d finite (small)
            )
            if qtype == Q.Q4_K:
                raw.reshape(rows, -1, size)[..., :4] = 0x10  # d, dmin: tiny finite f16 values
            writer.add_tensor(f"blk.{i}.{kind}.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
            name = "mlp.up_proj" if kind == "ffn_up" else "mlp.down_proj"
            expected[f"{hf}.{name}.weight"] = torch.from_numpy(
                dequantize(raw, qtype).reshape(rows, cols)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_synthetic_gguf_every_type_and_qk_unpermute(tmp_path):
    path = tmp_path / "tiny-llama-Q8_0.gguf"
    expected = _write_tiny_gguf(path)
    model = load_model(str(path))
    assert model.model_id == "tiny-llama"
    assert model.config.tie_word_embeddings is True
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (HEADS, KV_HEADS)
    assert set(model.weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.isfinite(tensor).all(), name
        torch.testing.assert_close(model.weights[name], tensor, atol=0, rtol=0, msg=name)


def test_unpermute_inverts_llama_cpp_permute():
    from tokenyard.models.gguf_loader import unpermute_qk

    w = torch.arange(9 * 64 * 3, dtype=torch.float32).reshape(9 * 64, 3)
    permuted = torch.from_numpy(_llama_cpp_permute(w.numpy(), 9))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 9), w)


# -- failures ------------------------------------------------------------------------


def test_unknown_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))


def test_truncated_gguf(tmp_path):
    source = default_model_path()
    truncated = tmp_path / "half.gguf"
    with open(source, "rb") as src:
        truncated.write_bytes(src.read(os.path.getsize(source) // 2))
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(truncated))


@pytest.mark.parametrize(
    "content",
    [
        b"",
        os.urandom(4096),
        b"GGUF" + os.urandom(4092),
        b"GGUF\x03\x00\x00\x00" + os.urandom(4088),
        b"GGML" * 100,
    ],
    ids=["empty", "garbage", "magic-then-garbage", "version-then-garbage", "wrong-magic"],
)
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError):
        load_model(str(path))


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'"):
        load_model(str(path))


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'bert'"):
        load_model(str(tmp_path))


def test_hf_folder_add_bos_token_flag(tmp_path):
    folder = tmp_path / "tiny-llama"
    _save_tiny_hf_model(folder, tie=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True}))
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.encode("hi") == [
        tokenizer.bos_token_id,
        *tokenizer.encode("hi", add_special_tokens=False),
    ]


def _write_f32_gguf(
    path: Path, arch: str, tensors: dict[str, np.ndarray], expert_count: int = 0
) -> None:
    """A 1-layer model with hidden size 64 (2 heads of 32, 1 kv head) and F32 tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    if expert_count:
        writer.add_expert_count(expert_count)
        writer.add_expert_used_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(c) for c in range(33, 33 + 16)])
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _attention_tensors(rng: np.random.Generator, bias: bool) -> dict[str, np.ndarray]:
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64)}
    tensors = {f"blk.0.{k}.weight": rng.standard_normal(s, np.float32) for k, s in shapes.items()}
    if bias:
        tensors |= {
            f"blk.0.{k}.bias": rng.standard_normal(s[0], np.float32)
            for k, s in shapes.items()
            if k != "attn_output"
        }
    return tensors | {
        "token_embd.weight": rng.standard_normal((16, 64), np.float32),
        "output_norm.weight": np.ones(64, np.float32),
        "output.weight": rng.standard_normal((16, 64), np.float32),
        "blk.0.attn_norm.weight": np.ones(64, np.float32),
        "blk.0.ffn_norm.weight": np.ones(64, np.float32),
    }


def test_qwen2_gguf_keeps_qk_layout_and_biases(tmp_path):
    rng = np.random.default_rng(1)
    tensors = _attention_tensors(rng, bias=True) | {
        "blk.0.ffn_gate.weight": rng.standard_normal((32, 64), np.float32),
        "blk.0.ffn_up.weight": rng.standard_normal((32, 64), np.float32),
        "blk.0.ffn_down.weight": rng.standard_normal((64, 32), np.float32),
    }
    _write_f32_gguf(tmp_path / "qwen.gguf", "qwen2", tensors)
    model = load_model(str(tmp_path / "qwen.gguf"))
    assert model.config.architecture == "qwen2"
    assert model.config.attention_bias is True
    assert model.config.tie_word_embeddings is False
    w = model.weights
    assert torch.equal(
        w["model.layers.0.self_attn.q_proj.weight"],
        torch.from_numpy(tensors["blk.0.attn_q.weight"]),
    )
    assert torch.equal(
        w["model.layers.0.self_attn.k_proj.bias"], torch.from_numpy(tensors["blk.0.attn_k.bias"])
    )
    assert torch.equal(w["lm_head.weight"], torch.from_numpy(tensors["output.weight"]))


def test_mixtral_style_gguf_experts(tmp_path):
    rng = np.random.default_rng(2)
    experts = {
        "w1": rng.standard_normal((4, 32, 64), np.float32),  # gate: [experts, ffn, hidden]
        "w2": rng.standard_normal((4, 64, 32), np.float32),  # down
        "w3": rng.standard_normal((4, 32, 64), np.float32),  # up
    }
    tensors = _attention_tensors(rng, bias=False) | {
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((4, 64), np.float32),
        "blk.0.ffn_gate_exps.weight": experts["w1"],
        "blk.0.ffn_down_exps.weight": experts["w2"],
        "blk.0.ffn_up_exps.weight": experts["w3"],
    }
    _write_f32_gguf(tmp_path / "moe.gguf", "llama", tensors, expert_count=4)
    model = load_model(str(tmp_path / "moe.gguf"))
    c = model.config
    assert (c.architecture, c.num_local_experts, c.num_experts_per_tok) == ("mixtral", 4, 2)
    moe = "model.layers.0.block_sparse_moe"
    assert torch.equal(
        model.weights[f"{moe}.gate.weight"], torch.from_numpy(tensors["blk.0.ffn_gate_inp.weight"])
    )
    for w, stacked in experts.items():
        for e in range(4):
            assert torch.equal(
                model.weights[f"{moe}.experts.{e}.{w}.weight"], torch.from_numpy(stacked[e])
            )
    # llama-family q is stored permuted by llama.cpp, so it must not come back unchanged
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"])
    assert not torch.equal(model.weights["model.layers.0.self_attn.q_proj.weight"], q)
