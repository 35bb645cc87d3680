"""The kernels' `decoder_layers` (a decode step's every layer in one C++ call) against the
layers called one by one from Python: the same kernels in the same order, so the hidden
states and the pool must come out equal to the bit."""

from __future__ import annotations

import pytest
import torch

from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.kernels.cpu.constants import KERNEL_AMX
from tokenyard.models.attention import AttnMetadata, PrefillSpan
from tokenyard.models.config import ModelConfig
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.quantize import quantize

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 3, 4, 2, 64, 16
HIDDEN, INTERMEDIATE, VOCAB = HEADS * HEAD_DIM, 512, 96


def _config(bias: bool = False) -> ModelConfig:
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
        attention_bias=bias,
    )


def _model(dtype: torch.dtype, mode: str, bias: bool = False) -> LlamaForCausalLM:
    g = torch.Generator().manual_seed(3)
    config = _config(bias)
    model = LlamaForCausalLM(config, max_positions=1024)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    weights["model.norm.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
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
            if bias and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                weights[p + name + ".bias"] = 0.1 * torch.randn(shape[0], generator=g)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[p + norm + ".weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
    model.load_weights(weights)
    return quantize(model.to(dtype), mode)


def _decode_step(rows: int, pool_dtype: torch.dtype, seed: int = 0):
    """A step of `rows` decode rows over contexts of 1 to 200 tokens in a random pool."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 200, (rows,), generator=g)
    blocks_per = -(-int(lens.max()) // BLOCK)
    num_blocks = rows * blocks_per + 1
    tables = torch.randperm(num_blocks - 1, generator=g)[: rows * blocks_per].view(rows, blocks_per)
    positions = lens - 1
    meta = AttnMetadata(
        slot_blocks=tables[torch.arange(rows), positions // BLOCK].contiguous(),
        slot_offsets=positions % BLOCK,
        num_decode=rows,
        decode_block_tables=tables.contiguous(),
        decode_context_lens=lens,
        block_size=BLOCK,
    )
    pool = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(pool_dtype)
    ids = torch.randint(0, VOCAB, (rows,), generator=g)
    return ids, positions, meta, pool


def _both(model: LlamaForCausalLM, ids, positions, meta, pool):
    """(hidden, pool) through decoder_layers, then layer by layer, each on a copy of the pool."""
    out = []
    for fused in (True, False):
        model.fused_layers = fused
        p = pool.clone()
        out.append((model(ids, positions, meta, p), p))
    return out


# Each CPU takes other kernels: bf16 layers run linear_amx and linear_i16 on AMX, linear_i16
# and linear_bf16 (the dense copy) on AVX512-VNNI; fp32 layers linear_i16 on AVX2.
CASES = [(dtype, mode) for dtype in (torch.bfloat16, torch.float32) for mode in ("int4", "int8")]


@pytest.fixture(scope="module")
def kernels():
    if cpu_kernels.ops() is None:
        pytest.skip("CPU kernels not built here")
    return cpu_kernels.ops()


def test_decoder_layers_equal_the_layers_one_by_one(kernels):
    ran = []
    for dtype, mode in CASES:
        model = _model(dtype, mode)
        for rows in (1, 3, 6, 17, 40):
            if model._build_fused_plan(rows, False) is None:
                continue  # this CPU runs these layers through torch's kernels
            ids, positions, meta, pool = _decode_step(rows, dtype, seed=rows)
            (fused, fused_pool), (layers, layers_pool) = _both(model, ids, positions, meta, pool)
            assert model._fused_plans, "the fused path did not run"
            assert fused.dtype == dtype and fused.shape == (rows, HIDDEN)
            assert torch.isfinite(fused.float()).all()
            assert torch.equal(fused, layers), (dtype, mode, rows)
            assert torch.equal(fused_pool, layers_pool), (dtype, mode, rows)
            assert not torch.equal(fused_pool, pool)  # this step's keys and values went in
            ran.append((dtype, mode, rows, model._build_fused_plan(rows, False)[1][0]))
    if not ran:
        pytest.skip("no quantized layout here runs the kernels decoder_layers takes")


def test_q_k_v_biases_go_through_decoder_layers_equal_to_the_bit(kernels):
    """Qwen2's layers: the q/k/v projection's bias is added after the kernel in both paths."""
    ran = 0
    for dtype, mode in CASES:
        model = _model(dtype, mode, bias=True)
        for rows in (1, 5):
            plan = model._build_fused_plan(rows, False)
            if plan is None:
                continue
            weights, _ = plan
            qkv_bias = model.layers[0].self_attn.qkv_proj.bias
            assert any(w is qkv_bias for w in weights)  # the bias travels with the layer
            ids, positions, meta, pool = _decode_step(rows, dtype, seed=rows + 11)
            (fused, fused_pool), (layers, layers_pool) = _both(model, ids, positions, meta, pool)
            assert torch.equal(fused, layers), (dtype, mode, rows)
            assert torch.equal(fused_pool, layers_pool), (dtype, mode, rows)
            # Without its bias the step differs: the kernel did add it.
            for layer in model.layers:
                layer.self_attn.qkv_proj.bias.zero_()
            model.fused_layers = True
            assert not torch.equal(model(ids, positions, meta, pool.clone()), fused)
            ran += 1
            break
    if not ran:
        pytest.skip("no quantized layout here runs the kernels decoder_layers takes")


def test_a_prompt_step_in_per_token_rows_takes_the_prompt_kernels(kernels):
    """Deterministic mode's prompt tokens come as decode rows of a prompt step: the plan is
    kept apart from a decode step's of the same size (on AMX: linear_amx at any size)."""
    model = _model(torch.bfloat16, "int4")
    if model._build_fused_plan(2, False) is None:
        pytest.skip("bf16 int4 layers do not run decoder_layers' kernels here")
    ids, positions, meta, pool = _decode_step(2, torch.bfloat16, seed=7)
    meta.prompt_step = True
    (fused, fused_pool), (layers, layers_pool) = _both(model, ids, positions, meta, pool)
    prompt_kinds = model._build_fused_plan(2, True)
    assert torch.equal(fused, layers) and torch.equal(fused_pool, layers_pool)
    assert set(model._fused_plans) == {(2, True)}
    assert prompt_kinds is not None
    if model.layers[0].self_attn.qkv_proj.kernel.name == "amx":
        assert set(prompt_kinds[1]) == {KERNEL_AMX}
        assert KERNEL_AMX not in model._build_fused_plan(2, False)[1]  # 2 decode rows: linear_i16


def test_layers_the_fused_path_does_not_take(kernels):
    model = _model(torch.bfloat16, "int4")
    ids, positions, meta, pool = _decode_step(4, torch.bfloat16)
    model.fused_layers = False
    assert model._fused_plan(model.embed_tokens(ids), pool, False) is None  # switched off
    unquantized = LlamaForCausalLM(_config(), max_positions=1024)
    assert unquantized._build_fused_plan(4, False) is None  # plain nn.Linear layers


def _fused_case(rows: int) -> tuple[LlamaForCausalLM, torch.dtype] | None:
    for dtype, mode in CASES:
        model = _model(dtype, mode)
        if model._build_fused_plan(rows, False) is not None:
            return model, dtype
    return None


def test_decoder_layers_refuse_what_does_not_fit(kernels):
    case = _fused_case(2)
    if case is None:
        pytest.skip("no quantized layout here runs the kernels decoder_layers takes")
    model, dtype = case
    ids, positions, meta, pool = _decode_step(2, dtype)
    weights, kinds = model._build_fused_plan(2, False)
    x = model.embed_tokens(ids)
    no_rows = torch.empty(0, dtype=torch.long)

    def call(kv_cache, span_blocks, spans):
        return kernels.decoder_layers(
            x,
            positions,
            model.rope.cos,
            model.rope.sin,
            kv_cache,
            meta.slot_blocks,
            meta.slot_offsets,
            meta.decode_block_tables,
            meta.decode_context_lens,
            no_rows,
            span_blocks,
            spans,
            weights,
            kinds,
            HEADS,
            KV_HEADS,
            HEAD_DIM**-0.5,
            1e-5,
        )

    assert torch.equal(call(pool.clone(), [], []), _both(model, ids, positions, meta, pool)[1][0])
    with pytest.raises(RuntimeError, match="every one of the pool's 2 layers"):
        call(pool[:, :2], [], [])
    blocks = meta.decode_block_tables[0]
    with pytest.raises(RuntimeError, match="span 0 does not fit"):
        call(pool, [blocks], [1, 2, 2])  # rows 1-2 of a 2-row step
    with pytest.raises(RuntimeError, match="span 0 does not fit"):
        call(pool, [blocks], [0, 2, 1 + BLOCK * len(blocks)])  # more context than its blocks
    with pytest.raises(RuntimeError, match=r"\(start, rows, context\) per span"):
        call(pool, [blocks], [0, 2])


def _mixed_step(pool_dtype: torch.dtype, seed: int = 1):
    """Decode rows, then a fresh prompt, a prompt's tail after a cached prefix and a short
    span of draft tokens to verify: every kind of row a CPU step splits between our kernel
    and torch's fused attention (AttnMetadata.cpu_split)."""
    g = torch.Generator().manual_seed(seed)
    # (tokens before the step, tokens in the step, prompt); one token: a decode row
    seqs = [
        (37, 1, False),
        (150, 1, False),
        (5, 1, False),
        (0, 20, True),
        (40, 5, True),
        (27, 3, False),
    ]
    widest = max(-(-(before + n) // BLOCK) for before, n, _ in seqs)
    num_blocks = len(seqs) * widest + 1
    ids = torch.randperm(num_blocks - 1, generator=g)[: len(seqs) * widest].view(len(seqs), widest)
    slot_blocks, slot_offsets, positions, prefills = [], [], [], []
    decode_tables, decode_lens = [], []
    row = 0
    for (before, n, prompt), table in zip(seqs, ids, strict=True):
        for p in range(before, before + n):
            slot_blocks.append(int(table[p // BLOCK]))
            slot_offsets.append(p % BLOCK)
            positions.append(p)
        if n == 1:
            decode_tables.append(table)
            decode_lens.append(before + 1)
        else:
            used = table[: -(-(before + n) // BLOCK)].contiguous()
            prefills.append(PrefillSpan(row, n, before + n, used, prompt))
        row += n
    meta = AttnMetadata(
        slot_blocks=torch.tensor(slot_blocks),
        slot_offsets=torch.tensor(slot_offsets),
        num_decode=len(decode_tables),
        decode_block_tables=torch.stack(decode_tables),
        decode_context_lens=torch.tensor(decode_lens),
        prefills=prefills,
        block_size=BLOCK,
    )
    pool = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(pool_dtype)
    tokens = torch.randint(0, VOCAB, (row,), generator=g)
    return tokens, torch.tensor(positions), meta, pool


@pytest.mark.parametrize("pool", ["model", "fp8"])
def test_mixed_steps_equal_the_layers_one_by_one(kernels, pool):
    ran = 0
    for dtype, mode in CASES:
        pool_dtype = dtype if pool == "model" else torch.float8_e4m3fn
        model = _model(dtype, mode)
        ids, positions, meta, kv = _mixed_step(pool_dtype)
        meta.prompt_step = True
        if model._build_fused_plan(len(ids), True) is None:
            continue
        (fused, fused_pool), (layers, layers_pool) = _both(model, ids, positions, meta, kv)
        assert torch.isfinite(fused.float()).all()
        assert torch.equal(fused, layers), (dtype, mode, pool)
        assert torch.equal(fused_pool.view(torch.uint8), layers_pool.view(torch.uint8))
        ran += 1
    if not ran:
        pytest.skip("no quantized layout here runs a prompt step through decoder_layers' kernels")
