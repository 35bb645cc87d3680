"""Paged attention in plain torch (the CPU path, and the reference for the Triton kernel).

A step's tokens are flattened into one batch of T rows, decode rows first:

    rows:  [d0 d1 ... d(B-1) | p0 chunk ......... | p1 chunk .... ]
            one token per      a prefill chunk per sequence,
            decoding sequence  any offset into its prompt

Every row's key and value are written into the pool at its slot; then decoding rows attend
over their block tables in one batched call, and each prefill chunk attends causally over
its context (cached prefix + earlier chunks + itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # first row of this chunk in the step's flattened batch
    num_tokens: int  # rows in this chunk
    context_len: int  # tokens attended to: computed before this chunk + the chunk itself
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] physical blocks, in order


@dataclass
class AttnMetadata:
    slot_blocks: torch.Tensor  # [T] block id that each row's K/V is written into
    slot_offsets: torch.Tensor  # [T] offset inside that block
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size] bool: attend
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], already rotated
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], already rotated
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim] (a view)
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    kv_layer[meta.slot_blocks, 0, meta.slot_offsets] = k
    kv_layer[meta.slot_blocks, 1, meta.slot_offsets] = v
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if meta.num_decode:
        b = meta.num_decode
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        kv = kv_layer[meta.decode_block_tables]  # [B, max_blocks, 2, block_size, H_kv, D]
        keys = kv[:, :, 0].reshape(b, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, H_kv, ctx, D]
        values = kv[:, :, 1].reshape(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:b].unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )  # [B, H, 1, D]
        out[:b] = o.squeeze(2)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.num_tokens)
        if span.context_len == span.num_tokens:  # nothing before this chunk: no gather needed
            keys, values, mask = k[rows], v[rows], None
        else:
            kv = kv_layer[span.block_ids]  # [n_blocks, 2, block_size, H_kv, D]
            keys = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[: span.context_len]
            values = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[: span.context_len]
            mask = _chunk_causal_mask(span.num_tokens, span.context_len, q.device)
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),  # [H, n, D]
            keys.transpose(0, 1),  # [H_kv, ctx, D]
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o.transpose(0, 1)
    return out


def _chunk_causal_mask(num_tokens: int, context_len: int, device: torch.device) -> torch.Tensor:
    """[n, ctx] bool: row i (absolute position ctx - n + i) sees keys 0..its own position."""
    first = context_len - num_tokens
    q_pos = torch.arange(first, context_len, device=device)[:, None]
    return torch.arange(context_len, device=device)[None, :] <= q_pos
