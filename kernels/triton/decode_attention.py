"""Paged decode attention with grouped-query heads, reading block tables in place.

One program per (sequence, query head). It walks the sequence's block table, one KV block
(block_size keys) at a time, with an online softmax in fp32:

    block_tables[b] = [7, 2, 9]          context_lens[b] = 35, block_size = 16
    keys 0..15 in block 7, 16..31 in block 2, 32..34 in block 9 (the rest masked)

Query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(
    q_ptr,
    pool_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    scale,
    head_dim,
    group,
    max_blocks,
    s_block,
    s_kv,
    s_off,
    s_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    kv_head = h // group
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    offs = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (b * num_heads + h) * head_dim + d, mask=d_mask, other=0.0)
    q = q.to(tl.float32)
    ctx = tl.load(lens_ptr + b)
    m = -float("inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
        block = tl.load(tables_ptr + b * max_blocks + n).to(tl.int64)
        base = pool_ptr + block * s_block + kv_head * s_head
        rows = base + offs[:, None] * s_off + d[None, :]
        valid = (n * BLOCK_SIZE + offs) < ctx
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(rows, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, BLOCK_D]
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(rows + s_kv, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        denom = denom * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / denom
    tl.store(
        out_ptr + (b * num_heads + h) * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, H, D] contiguous; kv_layer: [N, 2, bs, Hkv, D]; block_tables: [B, max_blocks]
    contiguous ints; context_lens: [B] (each at least 1). Returns [B, H, D]."""
    assert q.dim() == 3 and q.is_contiguous(), "q: [B, H, D], contiguous"
    batch, num_heads, head_dim = q.shape
    assert kv_layer.dim() == 5 and kv_layer.shape[1] == 2 and kv_layer.stride(4) == 1
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    assert kv_layer.shape[4] == head_dim and num_heads % num_kv_heads == 0
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"
    assert block_tables.dim() == 2 and block_tables.shape[0] == batch
    assert block_tables.is_contiguous() and context_lens.shape == (batch,)
    out = torch.empty_like(q)
    if batch:
        _decode_attention_kernel[(batch, num_heads)](
            q,
            kv_layer,
            block_tables,
            context_lens,
            out,
            scale,
            head_dim,
            num_heads // num_kv_heads,
            block_tables.shape[1],
            kv_layer.stride(0),
            kv_layer.stride(1),
            kv_layer.stride(2),
            kv_layer.stride(3),
            BLOCK_SIZE=block_size,
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


def decode_attention_torch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        ctx = int(context_lens[b])
        blocks = block_tables[b, : -(-ctx // block_size)]
        k = kv_layer[blocks, 0].reshape(-1, num_kv_heads, head_dim)[:ctx]  # [ctx, Hkv, D]
        v = kv_layer[blocks, 1].reshape(-1, num_kv_heads, head_dim)[:ctx]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,chd->hc", q[b].float(), k.float()) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hc,chd->hd", probs, v.float()).to(q.dtype)
    return out
