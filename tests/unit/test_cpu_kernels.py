"""The C++ CPU kernels against their torch twins in tokenyard.models.attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenyard import platforms
from tokenyard.kernels import cpu as cpu_kernels
from tokenyard.models import attention, kernel_choice
from tokenyard.models.attention import AttnMetadata, PrefillSpan, attend, paged_attention
from tokenyard.models.kernel_choice import SDPA, SPAN_ATTENTION

NUM_BLOCKS, NUM_LAYERS, BLOCK, H_KV, D = 40, 3, 16, 3, 64


@pytest.fixture(scope="module")
def ops():
    built = cpu_kernels.ops()
    if built is None:
        pytest.skip(
            "the CPU kernels could not be built here (no compiler or TOKENYARD_CPU_KERNELS=0)"
        )
    return built


def _pool(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK, H_KV, D, generator=g).to(dtype)


def _reference(q, kv_layer, tables, lens, scale):
    """The torch twin, in fp32 whatever the pool's dtype."""
    b = q.shape[0]
    keys = kv_layer[:, 0].float()[tables].view(b, -1, H_KV, D)
    values = kv_layer[:, 1].float()[tables].view(b, -1, H_KV, D)
    mask = (torch.arange(tables.shape[1] * BLOCK)[None] < lens[:, None])[:, None, None, :]
    return attend(
        q.float().unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask, scale
    ).squeeze(2)


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)]
)
# 1, 3, 5 and 8 query heads per KV head (8: the most the vector path holds, kMaxGroup)
@pytest.mark.parametrize("heads", [3, 9, 15, 24])
def test_decode_attention_matches_torch(ops, dtype, tol, heads):
    pool = _pool(dtype)
    kv_layer = pool[:, 1]  # a strided view, as the engine passes it
    lens = torch.tensor([1, 15, 16, 17, 100, 160])  # one token, block edges, many blocks
    width = int(-(-lens.max() // BLOCK))
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, D, generator=g).to(dtype)
    out = ops.decode_attention(q, kv_layer, tables, lens, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.float() - _reference(q, kv_layer, tables, lens, D**-0.5)).abs().max().item() < tol


def test_decode_attention_ignores_padding_past_the_context(ops):
    pool = _pool(torch.float32)
    tables = torch.tensor([[5, 6, 7]])
    lens = torch.tensor([20])
    q = torch.randn(1, 3, D)
    before = ops.decode_attention(q, pool[:, 0], tables, lens, 0.1)
    pool[7] = 1e4  # a block past the context, and the unused tail of block 6
    pool[6, :, :, 4:] = -1e4
    assert torch.equal(before, ops.decode_attention(q, pool[:, 0], tables, lens, 0.1))


@pytest.mark.parametrize("heads", [9, 15])  # 3 query heads per KV head (its own build), 5
def test_bf16_values_past_an_odd_context_are_never_read(ops, heads):
    """A bf16 pool's values go two keys at a time: with an odd context, the row after the
    last key (here NaN, as a reused block may hold anything) must not reach the output."""
    pool = _pool(torch.bfloat16)
    tables = torch.tensor([[5, 6, 7]])
    lens = torch.tensor([37])  # 18 pairs and a last key alone, in block 7
    q = torch.randn(1, heads, D).to(torch.bfloat16)
    before = ops.decode_attention(q, pool[:, 0], tables, lens, D**-0.5)
    reference = _reference(q, pool[:, 0], tables, lens, D**-0.5)  # torch's masking: NaN * 0
    assert (before.float() - reference).abs().max().item() < 2e-2
    pool[7, :, :, 5:] = float("nan")
    assert torch.equal(before, ops.decode_attention(q, pool[:, 0], tables, lens, D**-0.5))


def test_write_kv_matches_index_put(ops):
    for dtype in (torch.float32, torch.bfloat16):
        pool = _pool(dtype)
        k, v = torch.randn(5, H_KV, D).to(dtype), torch.randn(5, H_KV, D).to(dtype)
        blocks, offsets = torch.tensor([3, 3, 9, 10, 0]), torch.tensor([0, 1, 15, 2, 7])
        expected = pool.clone()
        expected[:, 2][blocks, :, offsets] = torch.stack((k, v), dim=1)
        ops.write_kv(k, v, pool[:, 2], blocks, offsets)
        assert torch.equal(pool, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_k_v_as_views_of_a_fused_projection_need_no_copy(ops, dtype):
    """The engine passes q, k and v split from one q/k/v output, rows 15 heads apart: the
    kernels read each row where it lies and answer as for contiguous copies."""
    heads, rows = 9, 6
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(rows, (heads + 2 * H_KV) * D, generator=g).to(dtype)
    q, k, v = qkv.split([heads * D, H_KV * D, H_KV * D], dim=-1)
    q, k, v = q.view(rows, heads, D), k.view(rows, H_KV, D), v.view(rows, H_KV, D)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    blocks, offsets = torch.tensor([3, 3, 9, 10, 0, 0]), torch.tensor([0, 1, 15, 2, 7, 8])
    pool, copies = _pool(dtype), _pool(dtype)
    ops.write_kv(k, v, pool[:, 1], blocks, offsets)
    ops.write_kv(k.contiguous(), v.contiguous(), copies[:, 1], blocks, offsets)
    assert torch.equal(pool, copies)
    tables = torch.tensor([[3, 9], [10, 0], [0, 3], [9, 10], [3, 0], [0, 9]])
    lens = torch.tensor([2, 19, 9, 30, 17, 1])
    out = ops.decode_attention(q, pool[:, 1], tables, lens, D**-0.5)
    assert out.is_contiguous() and out.shape == q.shape
    assert torch.equal(out, ops.decode_attention(q.contiguous(), pool[:, 1], tables, lens, D**-0.5))
    # the model's path hands the views over as they are
    assert attention._rows(q) is q and attention._rows(k) is k
    transposed = torch.randn(H_KV, rows, D).transpose(0, 1)  # heads not side by side
    assert attention._rows(transposed).is_contiguous()


def test_kernels_refuse_out_of_range_input(ops):
    pool = _pool(torch.float32)
    q = torch.randn(1, 3, D)
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.decode_attention(q, pool[:, 0], torch.tensor([[NUM_BLOCKS]]), torch.tensor([3]), 0.1)
    with pytest.raises(RuntimeError, match="context length"):
        ops.decode_attention(q, pool[:, 0], torch.tensor([[1]]), torch.tensor([BLOCK + 1]), 0.1)
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        k = torch.randn(1, H_KV, D)
        ops.write_kv(k, k, pool[:, 0], torch.tensor([0]), torch.tensor([BLOCK]))
    with pytest.raises(RuntimeError, match="share the pool's dtype"):
        ops.decode_attention(q.bfloat16(), pool[:, 0], torch.tensor([[1]]), torch.tensor([3]), 0.1)
    with pytest.raises(RuntimeError, match="share the pool's dtype"):  # only fp32 beside fp16
        half = _pool(torch.float16)
        ops.decode_attention(q.bfloat16(), half[:, 0], torch.tensor([[1]]), torch.tensor([3]), 0.1)
    with pytest.raises(RuntimeError, match="share a dtype with the pool"):
        k = torch.randn(1, H_KV, D, dtype=torch.bfloat16)
        ops.write_kv(k, k, pool[:, 0], torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="each row's heads contiguous"):
        k = torch.randn(H_KV, 2, D).transpose(0, 1)
        ops.write_kv(k, k, pool[:, 0], torch.tensor([0, 1]), torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="each row's heads contiguous"):
        q2 = torch.randn(3, 2, D).transpose(0, 1)
        ops.decode_attention(q2, pool[:, 0], torch.tensor([[1], [1]]), torch.tensor([3, 3]), 0.1)


def test_an_fp16_pool_beside_fp32_activations(ops):
    """EngineConfig.kv_cache_dtype's CPU default for fp32 engines: the kernels write fp32 keys
    and values into an fp16 pool rounded as torch rounds them, and attend over it in fp32."""
    pool = _pool(torch.float16)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(5, H_KV, D, generator=g) * 30, torch.randn(5, H_KV, D, generator=g)
    blocks, offsets = torch.tensor([3, 3, 9, 10, 0]), torch.tensor([0, 1, 15, 2, 7])
    expected = pool.clone()
    expected[:, 2][blocks, :, offsets] = torch.stack((k, v), dim=1).half()
    ops.write_kv(k, v, pool[:, 2], blocks, offsets)
    assert torch.equal(pool, expected)

    lens = torch.tensor([1, 17, 100, 160])
    width = int(-(-lens.max() // BLOCK))
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), 9, D, generator=g)
    out = ops.decode_attention(q, pool[:, 2], tables, lens, D**-0.5)
    assert out.dtype == torch.float32
    reference = _reference(q, pool[:, 2], tables, lens, D**-0.5)
    assert (out - reference).abs().max().item() < 1e-5
    # and the pool's rounding is all that separates it from an fp32 pool of the same values
    exact = _reference(q, pool[:, 2].float(), tables, lens, D**-0.5)
    assert torch.equal(reference, exact)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_an_fp8_pool_beside_bf16_or_fp32_activations(ops, act):
    """kv_cache_dtype="fp8": the kernels round keys and values to e4m3 as torch does (to
    nearest even, subnormals included), saturate past 448 where torch makes NaN, attend over
    the pool in fp32, and widen a span's rows back exactly (gather_kv)."""
    pool = _pool(FP8)
    g = torch.Generator().manual_seed(6)
    # magnitudes from e4m3's subnormals (under 2^-6) to past its largest number (448)
    k = torch.randn(6, H_KV, D, generator=g) * torch.logspace(-4, 3, 6)[:, None, None]
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -464.0])
    k, v = k.to(act), torch.randn(6, H_KV, D, generator=g).to(act)
    blocks, offsets = torch.tensor([3, 3, 9, 10, 0, 1]), torch.tensor([0, 1, 15, 2, 7, 0])
    expected = pool.clone()
    rounded = torch.stack((k, v), dim=1).float().clamp(-448, 448).to(FP8)
    expected[:, 2][blocks, :, offsets] = rounded
    ops.write_kv(k, v, pool[:, 2], blocks, offsets)
    assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))
    assert pool[3, 2, 0, 0, 0, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    assert attention.to_pool(k, FP8).view(torch.uint8).equal(rounded[:, 0].view(torch.uint8))

    lens = torch.tensor([1, 17, 100, 160])
    width = int(-(-lens.max() // BLOCK))
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in lens])
    q = torch.randn(len(lens), 9, D, generator=g).to(act)
    out = ops.decode_attention(q, pool[:, 2], tables, lens, D**-0.5)
    assert out.dtype == act
    tol = 1e-5 if act == torch.float32 else 2e-2
    assert (out.float() - _reference(q, pool[:, 2], tables, lens, D**-0.5)).abs().max() < tol

    gathered = ops.gather_kv(pool[:, 2], tables[3], 150, q)
    assert gathered.dtype == act and gathered.shape == (2, 150, H_KV, D)
    widened = pool[:, 2][tables[3]].transpose(0, 1).reshape(2, -1, H_KV, D)[:, :150].to(act)
    assert torch.equal(gathered, widened)
    with pytest.raises(RuntimeError, match="more than the blocks hold"):
        ops.gather_kv(pool[:, 2], tables[3][:2], 40, q)
    with pytest.raises(RuntimeError, match="does not pair with"):
        ops.gather_kv(pool[:, 2], tables[3], 10, q.half())


def test_paged_attention_is_the_same_with_and_without_kernels(ops, monkeypatch):
    """A mixed step (two decode rows and a prefill chunk over a cached prefix), both paths."""
    g = torch.Generator().manual_seed(3)
    t, heads = 2 + 5, 9
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (heads, H_KV, H_KV))
    meta_args = dict(
        slot_blocks=torch.tensor([1, 4, 8, 8, 8, 8, 8]),
        slot_offsets=torch.tensor([3, 0, 3, 4, 5, 6, 7]),
        num_decode=2,
        decode_block_tables=torch.tensor([[0, 1], [2, 4]]),
        decode_context_lens=torch.tensor([20, 17]),
        prefills=[
            PrefillSpan(start=2, num_tokens=5, context_len=24, block_ids=torch.tensor([7, 8]))
        ],
        block_size=BLOCK,
    )
    # fp16: the fp32 engine's default pool; fp8: kv_cache_dtype="fp8"
    for pool_dtype in (torch.float32, torch.float16, FP8):
        outs, pools = [], []
        for use_kernels in (True, False):
            pool = _pool(pool_dtype, seed=4)
            monkeypatch.setattr(
                attention.cpu_kernels, "ops", (lambda: ops) if use_kernels else (lambda: None)
            )
            outs.append(paged_attention(q, k, v, pool[:, 0], AttnMetadata(**meta_args), D**-0.5))
            pools.append(pool)
        assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
        assert outs[0].dtype == torch.float32
        assert (outs[0] - outs[1]).abs().max().item() < 1e-5, pool_dtype


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_prefill_chunks_attend_through_the_kernel_as_the_torch_path_does(
    ops, dtype, tol, monkeypatch
):
    """Two prefill chunks in one step, one fresh (no cached prefix) and one after a 50-token
    prefix, long enough that the kernel splits the rows between threads by cost and reads
    whole tiles of keys as well as tails; the kernel's output against the torch path's."""
    g = torch.Generator().manual_seed(8)
    fresh, later, prefix, heads = 70, 45, 50, 9
    t = fresh + later
    q, k, v = (torch.randn(t, h, D, generator=g).to(dtype) for h in (heads, H_KV, H_KV))
    first_blocks = torch.tensor([11, 2, 30, 5, 17])
    second_blocks = torch.tensor([9, 21, 3, 38, 14, 6, 25])
    positions = torch.cat([torch.arange(fresh), torch.arange(prefix, prefix + later)])
    slot_blocks = torch.cat(
        [first_blocks[torch.arange(fresh) // BLOCK], second_blocks[(positions[fresh:]) // BLOCK]]
    )
    meta_args = dict(
        slot_blocks=slot_blocks,
        slot_offsets=positions % BLOCK,
        prefills=[
            PrefillSpan(start=0, num_tokens=fresh, context_len=fresh, block_ids=first_blocks),
            PrefillSpan(
                start=fresh, num_tokens=later, context_len=prefix + later, block_ids=second_blocks
            ),
        ],
        block_size=BLOCK,
    )
    outs = []
    for use_kernels in (True, False):
        pool = _pool(dtype, seed=9)
        if not use_kernels:
            monkeypatch.setattr(attention.cpu_kernels, "ops", lambda: None)
        outs.append(paged_attention(q, k, v, pool[:, 2], AttnMetadata(**meta_args), D**-0.5))
    assert outs[0].dtype == dtype
    assert (outs[0].float() - outs[1].float()).abs().max().item() < tol


def _mixed_step(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, int]:
    """A step of two decode rows, a short chunk (4 rows: stays in our decode kernel), a fresh
    40-row chunk and 20 rows after a 33-token prefix: q, k, v, AttnMetadata's arguments and
    the rows before the long chunks."""
    g = torch.Generator().manual_seed(12)
    short, fresh, later, prefix, heads = 4, 40, 20, 33, 9
    assert short < attention.SDPA_MIN_ROWS <= later
    t = 2 + short + fresh + later
    q, k, v = (torch.randn(t, h, D, generator=g).to(dtype) for h in (heads, H_KV, H_KV))
    short_blocks, fresh_blocks, later_blocks = (
        torch.tensor([12, 13]),
        torch.tensor([11, 2, 30]),
        torch.tensor([9, 21, 3, 38]),
    )
    positions = torch.cat(
        [
            torch.tensor([19, 16]),
            torch.arange(20, 24),
            torch.arange(fresh),
            prefix + torch.arange(later),
        ]
    )
    blocks = [torch.tensor([1, 4])]  # the decode rows: positions 19 and 16
    blocks.append(short_blocks[positions[2 : 2 + short] // BLOCK])
    blocks.append(fresh_blocks[positions[2 + short : 2 + short + fresh] // BLOCK])
    blocks.append(later_blocks[positions[2 + short + fresh :] // BLOCK])
    meta_args = dict(
        slot_blocks=torch.cat(blocks),
        slot_offsets=positions % BLOCK,
        num_decode=2,
        decode_block_tables=torch.tensor([[0, 1], [2, 4]]),
        decode_context_lens=torch.tensor([20, 17]),
        prefills=[
            PrefillSpan(start=2, num_tokens=short, context_len=24, block_ids=short_blocks),
            PrefillSpan(
                start=2 + short, num_tokens=fresh, context_len=fresh, block_ids=fresh_blocks
            ),
            PrefillSpan(
                start=2 + short + fresh,
                num_tokens=later,
                context_len=prefix + later,
                block_ids=later_blocks,
            ),
        ],
        block_size=BLOCK,
    )
    return q, k, v, meta_args, 2 + short


@pytest.mark.parametrize(
    "dtype, pool_dtype, tol",
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, 3e-2),
        # keys and values widened by gather_kv: in fp32, 1e-5 holds only if the fused path
        # reads them rounded to e4m3 as our kernel does (unrounded, they differ by ~1e-2)
        (torch.float32, torch.float8_e4m3fn, 1e-5),
        (torch.bfloat16, torch.float8_e4m3fn, 3e-2),
    ],
)
def test_long_prefill_chunks_in_torchs_fused_attention_match_our_kernel(
    ops, dtype, pool_dtype, tol, monkeypatch
):
    """The AMX path: a step of two decode rows, a short chunk (stays in our kernel), a fresh
    chunk and a chunk after a prefix (both in torch's fused attention), against the same step
    all in our kernel; each row lands where it belongs."""
    q, k, v, meta_args, before = _mixed_step(dtype)
    outs, pools = [], []
    for fused in (True, False):
        kernel = SDPA if fused else None  # as on AMX: torch's fused attention, or rows
        monkeypatch.setattr(attention, "prefill_span_kernel", lambda dtype, heads, k=kernel: k)
        pool = _pool(pool_dtype, seed=13)
        outs.append(paged_attention(q, k, v, pool[:, 1], AttnMetadata(**meta_args), D**-0.5))
        pools.append(pool)
    assert torch.equal(pools[0].view(torch.uint8), pools[1].view(torch.uint8))
    assert outs[0].dtype == dtype
    err = (outs[0].float() - outs[1].float()).abs()
    assert err.max().item() < tol
    # the rows our kernel computed in both runs are the same computation
    assert torch.equal(outs[0][:before], outs[1][:before])


def test_a_short_prompt_span_attends_in_torchs_fused_kernel_where_long_ones_do(ops, monkeypatch):
    """The AMX path: a prompt's tail after a prefix-cache hit (4 rows) goes where its cold
    prefill went, torch's fused attention; a draft's 4 rows to verify stay in our kernel."""
    g = torch.Generator().manual_seed(14)
    rows, prefix, heads = 4, 29, 9
    t = 2 * rows
    q, k, v = (torch.randn(t, h, D, generator=g).to(torch.bfloat16) for h in (heads, H_KV, H_KV))
    tail_blocks, draft_blocks = torch.tensor([5, 17, 22]), torch.tensor([8, 26, 31])
    positions = torch.cat([prefix + torch.arange(rows), 40 + torch.arange(rows)])

    def meta() -> AttnMetadata:  # a step's own (it keeps how its rows split: cpu_split)
        return AttnMetadata(
            slot_blocks=torch.cat(
                [tail_blocks[positions[:rows] // BLOCK], draft_blocks[positions[rows:] // BLOCK]]
            ),
            slot_offsets=positions % BLOCK,
            prefills=[
                PrefillSpan(0, rows, prefix + rows, tail_blocks, prompt=True),
                PrefillSpan(rows, rows, 40 + rows, draft_blocks),
            ],
            block_size=BLOCK,
        )

    fused_rows: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        fused_rows.append(query.shape[2])
        return sdpa(query, *args, **kwargs)

    outs = []
    for fused in (True, False):
        kernel = SDPA if fused else None  # as on AMX: torch's fused attention, or rows
        monkeypatch.setattr(attention, "prefill_span_kernel", lambda dtype, heads, k=kernel: k)
        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counted)
        outs.append(paged_attention(q, k, v, _pool(torch.bfloat16, seed=15)[:, 1], meta(), D**-0.5))
    assert fused_rows == [rows]  # the prompt span only, and only where the fused path is on
    assert (outs[0].float() - outs[1].float()).abs().max().item() < 1e-2
    assert torch.equal(outs[0][rows:], outs[1][rows:])  # the draft's rows: our kernel both times


@pytest.fixture
def span_ops(ops):
    if not ops.span_available():
        pytest.skip("span_attention is built only for CPUs with AVX512-BF16")
    return ops


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim", [(9, 3, 64), (3, 3, 64), (15, 3, 64), (16, 2, 64), (8, 2, 128)]
)
@pytest.mark.parametrize(
    "rows, ctx", [(1, 1), (5, 5), (17, 17), (160, 160), (16, 40), (33, 100), (1, 37)]
)
def test_span_attention_matches_torch(span_ops, heads, kv_heads, head_dim, rows, ctx):
    """Causal attention of a span's rows (the last `rows` of `ctx` positions): every group
    size the kernel builds a tile for, odd and block-crossing lengths, q as rows of a wider
    tensor (a view of the fused q/k/v projection)."""
    g = torch.Generator().manual_seed(rows * 1000 + ctx)
    q = torch.randn(rows, heads + 2, head_dim, generator=g).to(torch.bfloat16)[:, :heads]
    k, v = (torch.randn(ctx, kv_heads, head_dim, generator=g).to(torch.bfloat16) for _ in "kv")
    scale = head_dim**-0.5
    out = span_ops.span_attention(q, k, v, scale)
    mask = attention._chunk_causal_mask(rows, ctx, q.device)
    reference = attend(
        *(t.float().transpose(0, 1)[None] for t in (q, k, v)), mask[None, None], scale
    )[0].transpose(0, 1)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert (out.float() - reference).abs().max().item() < 2e-2


def test_span_attention_refuses_what_it_cannot_take(span_ops):
    q, k = torch.zeros(4, 9, 64, dtype=torch.bfloat16), torch.zeros(8, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16"):
        span_ops.span_attention(q.float(), k.float(), k.float(), 0.1)
    with pytest.raises(RuntimeError, match="ctx >= rows"):
        span_ops.span_attention(q, k[:3], k[:3], 0.1)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        span_ops.span_attention(q[..., :32], k[..., :32], k[..., :32], 0.1)
    with pytest.raises(RuntimeError, match="8 query heads"):
        span_ops.span_attention(torch.zeros(4, 27, 64, dtype=torch.bfloat16), k, k, 0.1)


def test_a_model_the_span_kernel_cannot_take_keeps_its_spans_rows(span_ops, monkeypatch):
    """span_attention takes head_dim 64 or 128 and up to 8 query heads per KV head; another
    model's prompt chunks stay rows of decode attention (torch's fused attention is the
    slow one without AMX)."""
    zen4 = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}  # AVX512-BF16 without AMX
    caps = kernel_choice.Capabilities(
        platforms.CpuInfo(frozenset(zen4)), kernel_choice.capabilities().built, 2
    )
    monkeypatch.setattr(kernel_choice, "capabilities", lambda: caps)

    def spans(heads: tuple[int, int, int]) -> int:
        meta = AttnMetadata(
            slot_blocks=torch.zeros(20, dtype=torch.long),
            slot_offsets=torch.arange(20) % BLOCK,
            prefills=[PrefillSpan(0, 20, 20, torch.tensor([0, 1]), prompt=True)],
            block_size=BLOCK,
        )
        return len(meta.cpu_split(torch.bfloat16, heads).spans)

    assert spans((9, 3, 64)) == 1 and spans((8, 2, 128)) == 1
    assert spans((9, 3, 32)) == spans((9, 3, 80)) == spans((27, 3, 64)) == 0


def test_prefill_spans_in_our_span_kernel_match_their_rows(span_ops, monkeypatch):
    """The path of CPUs with AVX512-BF16 and no AMX: the long chunks of a mixed step in
    span_attention against the same step with every row through decode attention; the
    decode rows and the short chunk are the same computation both times."""
    q, k, v, meta_args, before = _mixed_step(torch.bfloat16)
    calls: list[int] = []
    real = span_ops.span_attention

    def counted(query, *args):
        calls.append(query.shape[0])
        return real(query, *args)

    monkeypatch.setattr(span_ops, "span_attention", counted)
    outs = []
    for spans in (True, False):
        kernel = SPAN_ATTENTION if spans else None  # AVX512-BF16 without AMX, or rows
        monkeypatch.setattr(attention, "prefill_span_kernel", lambda dtype, heads, k=kernel: k)
        pool = _pool(torch.bfloat16, seed=13)
        outs.append(paged_attention(q, k, v, pool[:, 1], AttnMetadata(**meta_args), D**-0.5))
    assert calls == [40, 20]  # the two long chunks, only where the span kernel is on
    assert (outs[0].float() - outs[1].float()).abs().max().item() < 2e-2
    assert torch.equal(outs[0][:before], outs[1][:before])


@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 1e-2)]
)
def test_fused_steps_match_their_torch_twins(ops, dtype, tol, monkeypatch):
    from tokenyard.models import fused

    g = torch.Generator().manual_seed(5)
    rows, dim, width = 7, 40, 35  # widths that leave a tail past the 8- and 16-wide vector loops
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype)
    weight = torch.rand(dim, generator=g).to(dtype)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 2047, 3])
    angles = torch.arange(2048)[:, None] * torch.rand(1, 8, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # head_dim 16
    qkv = torch.randn(rows, 5 * 16, generator=g).to(dtype)

    def run():
        normed, summed = fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
        rotated = qkv.clone()
        fused.rotary_(rotated, positions, cos, sin, num_heads=4, head_dim=16)  # the 5th head stays
        first_layer = fused.add_rms_norm(x.clone(), None, weight, 1e-5)[0]  # no residual yet
        return normed, summed, rotated, fused.silu_and_mul(gate_up), first_layer

    with_kernels = run()
    monkeypatch.setattr(fused.cpu_kernels, "ops", lambda: None)
    for got, want in zip(with_kernels, run(), strict=True):
        assert got.dtype == dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(with_kernels[2][:, 64:], qkv[:, 64:])


def test_kernels_can_be_switched_off(ops):
    """TOKENYARD_CPU_KERNELS=0 leaves every caller on the torch twins; otherwise the cached
    object loads without a build."""
    import os
    import subprocess
    import sys

    probe = "from tokenyard.kernels import cpu; print(cpu.ops() is not None)"
    for value, expected in (("0", "False"), ("1", "True")):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "TOKENYARD_CPU_KERNELS": value},
            check=True,
        )
        assert out.stdout.strip() == expected


@pytest.mark.parametrize(
    "head_dim", [48, 128]
)  # 48: the portable loop and vector tails; 128: the other vector width
def test_decode_attention_other_head_dims(ops, head_dim):
    g = torch.Generator().manual_seed(6)
    pool = torch.randn(12, 1, 2, BLOCK, 2, head_dim, generator=g)
    kv_layer = pool[:, 0]
    tables, lens = torch.tensor([[3, 7, 1], [0, 2, 0]]), torch.tensor([40, 20])
    q = torch.randn(2, 4, head_dim, generator=g)
    keys = kv_layer[:, 0][tables].view(2, -1, 2, head_dim)
    values = kv_layer[:, 1][tables].view(2, -1, 2, head_dim)
    mask = (torch.arange(3 * BLOCK)[None] < lens[:, None])[:, None, None, :]
    ref = attend(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask, 0.2).squeeze(2)
    assert (ops.decode_attention(q, kv_layer, tables, lens, 0.2) - ref).abs().max().item() < 1e-5


def test_int8_linear_with_a_ragged_inner_dimension(ops):
    g = torch.Generator().manual_seed(7)
    weight = torch.randint(
        -127, 128, (24, 40), generator=g, dtype=torch.int8
    )  # 40: not a multiple of 32
    scale = torch.rand(24, generator=g)
    for rows in (1, 3, 6):  # 6 rows: a chunk of 4 and a chunk of 2
        x = torch.randn(rows, 40, generator=g)
        want = x @ (weight.float() * scale[:, None]).T
        assert torch.allclose(ops.int8_linear(x, weight, scale), want, rtol=1e-5, atol=1e-3)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        ops.int8_linear(torch.randn(17, 40), weight, scale)


@pytest.mark.parametrize("vocab", [1, 7, 8, 16, 17, 33, 49_152])  # tails of both vector widths
def test_argmax_rows_is_torchs_max_index(ops, vocab):
    """The greedy sampler's kernel: the first of equal maxima, a NaN where torch's max
    propagates one (its first), rows of -inf alike."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[1] = 2.0  # all equal: index 0
    logits[2, vocab // 2 :] = logits[2].max() + 1  # equal maxima from the middle on
    logits[3] = float("-inf")
    logits[4, -1] = float("nan")
    logits[4, vocab // 3] = float("nan")
    logits[5, 0] = float("inf")
    assert torch.equal(ops.argmax_rows(logits), logits.max(dim=-1).indices)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.argmax_rows(logits.to(torch.bfloat16))


def _i16_operands(rows: int, n: int, k: int, seed: int = 0):
    """int4 weights in linear_i16's layout and fp32 activations."""
    from tokenyard.models import quantize

    g = torch.Generator().manual_seed(seed)
    levels = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale, zero = torch.rand(n, k // 32, generator=g), torch.randn(n, k // 32, generator=g)
    packed, scales, zeros = quantize.pack_i16(levels, scale, zero)
    return torch.randn(rows, k, generator=g), packed, scales, zeros


class _PythonThread:
    """A Python thread that notes the time whenever it holds the interpreter, then sleeps
    for a moment (letting the GIL go) and asks for it again."""

    def __init__(self, pause: float = 0.0005) -> None:
        import threading

        self.times: list[float] = []
        self._pause = pause
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import time

        while not self._stop.is_set():
            self.times.append(time.perf_counter())
            time.sleep(self._pause)

    def __enter__(self) -> _PythonThread:
        self._thread.start()
        while not self.times:
            pass
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def test_long_kernels_let_other_python_threads_run(ops):
    """The GEMMs and attention release the GIL: a worker's event loop thread runs while the
    engine thread is in them. With the GIL held the other thread runs only once a call has
    returned, so none of its times falls in the first half of the call."""
    import time

    if not ops.i16_available():
        pytest.skip("linear_i16 needs AVX2")
    # Two threads whatever the host, so that each call lasts long enough to tell (about
    # 100 and 80 ms on a 2-core Zen 4).
    x, packed, scales, zeros = _i16_operands(2048, 2048, 2048)
    calls = {"linear_i16": lambda: ops.linear_i16(x, packed, scales, zeros)}
    pool = _pool(torch.float32)
    lens = torch.full((2048,), 2000)  # the pool's 40 blocks over and over
    tables = torch.randint(0, NUM_BLOCKS, (2048, 125))
    q = torch.randn(2048, 9, D)
    calls["decode_attention"] = lambda: ops.decode_attention(q, pool[:, 1], tables, lens, D**-0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, call in calls.items():
            call()  # a first call may import or initialise something that waits without the GIL
            with _PythonThread() as other:
                start = time.perf_counter()
                call()
                end = time.perf_counter()
            inside = [t for t in other.times if start < t < start + 0.5 * (end - start)]
            assert end - start > 0.02, f"{name}: the call is too short to tell"
            assert inside, f"{name} held the GIL for {1e3 * (end - start):.0f} ms"
    finally:
        torch.set_num_threads(threads)


def test_results_do_not_depend_on_which_thread_takes_a_share(ops):
    """Threads take runs of items from each other's shares (parallel_items): with a Python
    thread competing for the cores, which thread computes which outputs changes from call to
    call, and every call must still give what one thread alone gives, bit for bit."""
    from tokenyard.models import quantize

    threads = torch.get_num_threads()
    pool = _pool(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 300, (40,), generator=g)
    tables = torch.randint(0, NUM_BLOCKS, (40, 19), generator=g)
    q = torch.randn(40, 9, D, generator=g).to(torch.bfloat16)
    calls = {"decode_attention": lambda: ops.decode_attention(q, pool[:, 1], tables, lens, 0.125)}
    if ops.i16_available():
        x, packed, scales, zeros = _i16_operands(40, 1024, 512)
        calls["linear_i16"] = lambda: ops.linear_i16(x, packed, scales, zeros)
    if ops.pairs_available():
        w = quantize.pack_pairs(torch.randn(1040, 512, generator=g).to(torch.bfloat16))
        xb = torch.randn(40, 512, generator=g).to(torch.bfloat16)
        calls["linear_bf16"] = lambda: ops.linear_bf16(xb, w, False)
    try:
        torch.set_num_threads(1)
        alone = {name: call() for name, call in calls.items()}
        with _PythonThread():
            for n in (2, 3, 4):  # 3 and 4: more shares than cores, each stolen from
                torch.set_num_threads(n)
                for _ in range(10):
                    for name, call in calls.items():
                        assert torch.equal(call(), alone[name]), (name, n)
    finally:
        torch.set_num_threads(threads)
