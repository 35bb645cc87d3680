"""What a quantized model keeps beside its quantized weights: the dense copies for big steps
(EngineConfig.dense_copies) and an embedding table narrowed where that is exact
(engine.memory.compact_embeddings)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenyard import platforms
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.memory import compact_embeddings
from tokenyard.models import kernel_choice as kc
from tokenyard.models import quantize as quantize_module
from tokenyard.models.attention import AttnMetadata
from tokenyard.models.config import ModelConfig
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.quantize import (
    QuantizedLinear,
    dense_copy_bytes,
    keeps_dense,
    quantize,
)

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 2, 4, 2, 64, 16
HIDDEN, INTERMEDIATE, VOCAB = HEADS * HEAD_DIM, 512, 96

ZEN4 = kc.Capabilities(
    platforms.CpuInfo(frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})),
    frozenset({"ops", "i16", "vnni", "pairs", "span"}),
    2,
)
AVX2 = kc.Capabilities(
    platforms.CpuInfo(frozenset({"avx2", "fma", "f16c"})), frozenset({"ops", "i16"}), 2
)


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )


def _model(dtype: torch.dtype, embed_dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """A tiny tied Llama in `dtype` whose embedding values are exact in `embed_dtype`."""
    g = torch.Generator().manual_seed(5)
    model = LlamaForCausalLM(_config(), max_positions=1024)
    embed = torch.randn(VOCAB, HIDDEN, generator=g).to(embed_dtype).float()
    weights = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(HIDDEN)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {
        "self_attn.q_proj": (q, HIDDEN),
        "self_attn.k_proj": (kv, HIDDEN),
        "self_attn.v_proj": (kv, HIDDEN),
        "self_attn.o_proj": (HIDDEN, q),
        "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
        "mlp.up_proj": (INTERMEDIATE, HIDDEN),
        "mlp.down_proj": (HIDDEN, INTERMEDIATE),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in shapes.items():
            weights[p + name + ".weight"] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[p + norm + ".weight"] = torch.ones(HIDDEN)
    model.load_weights(weights)
    return model.to(dtype)


def _projection_bytes(model: nn.Module) -> int:
    return sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, nn.Linear)
    )


def test_dense_copies_are_counted_where_the_kernel_keeps_them(monkeypatch):
    bf16 = _model(torch.bfloat16)
    monkeypatch.setattr(kc, "capabilities", lambda: ZEN4)
    # linear_bf16's copies: every projection and the output projection, in bf16
    assert dense_copy_bytes(bf16, "int4") == _projection_bytes(bf16)
    assert dense_copy_bytes(bf16, "fp8") == 0
    monkeypatch.setattr(kc, "capabilities", lambda: AVX2)
    fp32 = _model(torch.float32)
    assert dense_copy_bytes(fp32, "int4") == 0  # linear_i16 at every row count, no copy


def test_auto_keeps_dense_copies_up_to_the_limit(monkeypatch):
    model = _model(torch.bfloat16)
    monkeypatch.setattr(kc, "capabilities", lambda: ZEN4)
    size = dense_copy_bytes(model, "int4")
    assert keeps_dense(model, "int4", "auto")
    assert keeps_dense(model, "int4", "all") and not keeps_dense(model, "int4", "none")
    monkeypatch.setattr(quantize_module, "DENSE_COPIES_MAX_BYTES", size - 1)
    assert not keeps_dense(model, "int4", "auto")
    assert keeps_dense(model, "int4", "all")


def test_without_dense_copies_no_layer_holds_one(monkeypatch):
    monkeypatch.setattr(kc, "capabilities", lambda: ZEN4)
    model = quantize(_model(torch.bfloat16), "int4", keep_dense=False)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.dense is None and m.pairs is None for m in layers)
    assert all(m.kernel.dense is None for m in layers)


def test_dense_copies_setting_is_checked():
    with pytest.raises(ValueError, match="dense_copies"):
        EngineConfig(dense_copies="some")


def _decode_step(rows: int):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 40, (rows,), generator=g)
    per = -(-int(lens.max()) // BLOCK)
    tables = torch.arange(rows * per).view(rows, per)
    positions = lens - 1
    meta = AttnMetadata(
        slot_blocks=tables[torch.arange(rows), positions // BLOCK].contiguous(),
        slot_offsets=positions % BLOCK,
        num_decode=rows,
        decode_block_tables=tables.contiguous(),
        decode_context_lens=lens,
        block_size=BLOCK,
    )
    pool = torch.randn(rows * per, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    return torch.randint(0, VOCAB, (rows,), generator=g), positions, meta, pool.half()


def test_an_exact_narrow_embedding_gives_the_same_step_to_the_bit():
    ids, positions, meta, pool = _decode_step(3)
    wide = quantize(_model(torch.float32), "int4")
    narrow = quantize(_model(torch.float32), "int4")
    if isinstance(narrow.lm_head, QuantizedLinear) and narrow.lm_head.dense is not None:
        pytest.skip("this CPU keeps the output projection's dense copy in the table itself")
    assert compact_embeddings(narrow)
    assert narrow.embed_tokens.weight.dtype == torch.bfloat16
    outs = []
    for model in (wide, narrow):
        hidden = model(ids, positions, meta, pool.clone())
        outs.append((hidden, model.logits(hidden)))
    assert outs[1][0].dtype == torch.float32
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_an_embedding_is_narrowed_only_where_exact_and_unshared(monkeypatch):
    monkeypatch.setattr(kc, "capabilities", lambda: AVX2)  # no dense output projection
    fp16_values = quantize(_model(torch.float32, embed_dtype=torch.float16), "int4")
    assert compact_embeddings(fp16_values)  # bf16 would round them: fp16 holds them
    assert fp16_values.embed_tokens.weight.dtype == torch.float16
    full = quantize(_model(torch.float32, embed_dtype=torch.float32), "int4")
    assert not compact_embeddings(full)  # fp32 values: neither holds them
    assert full.embed_tokens.weight.dtype == torch.float32
    tied = _model(torch.float32)  # unquantized: the output projection multiplies by it
    assert not compact_embeddings(tied)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert not compact_embeddings(_model(torch.bfloat16))  # not an fp32 table
