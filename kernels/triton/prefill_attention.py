"""Causal attention for prefill chunks over a cached prefix, reading block tables in place.

A step carries S prefill chunks; chunk s has num_tokens[s] query rows starting at row
starts[s] of q, and attends to context_lens[s] keys: everything computed before it (a
prefix-cache hit, earlier chunks) and itself, already written to the pool (kv_write.py).

    keys:    [ cached prefix ............ | this chunk ]      (context_len keys)
    queries:                              [ this chunk ]      (num_tokens rows)
    query row i sits at position context_len - num_tokens + i and sees keys 0..that position.

One program per (chunk, query head, BLOCK_M query rows), walking the chunk's block table one
KV block at a time with an online softmax in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_attention_kernel(
    q_ptr,
    pool_ptr,
    tables_ptr,
    starts_ptr,
    ntok_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    num_heads = tl.num_programs(1)
    n_tok = tl.load(ntok_ptr + s)
    if mb * BLOCK_M >= n_tok:
        return
    start = tl.load(starts_ptr + s)
    ctx = tl.load(lens_ptr + s)
    kv_head = h // group
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = i < n_tok
    q_pos = ctx - n_tok + i
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_rows = q_ptr + ((start + i[:, None]) * num_heads + h) * head_dim + d[None, :]
    q = tl.load(q_rows, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    offs = tl.arange(0, BLOCK_SIZE)
    m = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    last = tl.minimum(ctx - n_tok + (mb + 1) * BLOCK_M, ctx)  # keys past this are masked
    for n in range(0, tl.cdiv(last, BLOCK_SIZE)):
        block = tl.load(tables_ptr + s * max_blocks + n).to(tl.int64)
        rows = pool_ptr + block * s_block + kv_head * s_head + offs[:, None] * s_off + d[None, :]
        k_pos = n * BLOCK_SIZE + offs
        kv_mask = (k_pos < ctx)[:, None] & d_ok[None, :]
        k = tl.load(rows, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BLOCK_M, BLOCK_SIZE]
        seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < ctx)[None, :]
        scores = tl.where(seen, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows past the chunk's end
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = tl.load(rows + s_kv, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    o_rows = out_ptr + ((start + i[:, None]) * num_heads + h) * head_dim + d[None, :]
    tl.store(o_rows, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    num_tokens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_m: int = 16,
) -> None:
    """Write each chunk's attention output into ``out`` rows (q, out: [T, H, D] contiguous).

    block_tables: [S, max_blocks] contiguous ints; starts, num_tokens, context_lens: [S]."""
    assert q.dim() == 3 and q.is_contiguous() and out.shape == q.shape and out.is_contiguous()
    _, num_heads, head_dim = q.shape
    assert kv_layer.dim() == 5 and kv_layer.shape[1] == 2 and kv_layer.stride(4) == 1
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    assert kv_layer.shape[4] == head_dim and num_heads % num_kv_heads == 0
    assert block_size & (block_size - 1) == 0, "block_size: a power of two"
    spans = block_tables.shape[0]
    assert block_tables.is_contiguous() and starts.shape == num_tokens.shape == (spans,)
    assert context_lens.shape == (spans,)
    if not spans:
        return
    max_rows = int(num_tokens.max())
    grid = (spans, num_heads, triton.cdiv(max_rows, block_m))
    _prefill_attention_kernel[grid](
        q,
        kv_layer,
        block_tables,
        starts,
        num_tokens,
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
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )


def prefill_attention_torch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    num_tokens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    group = num_heads // num_kv_heads
    for s in range(block_tables.shape[0]):
        start, n, ctx = int(starts[s]), int(num_tokens[s]), int(context_lens[s])
        blocks = block_tables[s, : -(-ctx // block_size)]
        k = kv_layer[blocks, 0].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = kv_layer[blocks, 1].reshape(-1, num_kv_heads, head_dim)[:ctx]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,chd->hnc", q[start : start + n].float(), k.float()) * scale
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        scores = scores.masked_fill(~(torch.arange(ctx)[None, :] <= q_pos), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + n] = torch.einsum("hnc,chd->nhd", probs, v.float()).to(q.dtype)
