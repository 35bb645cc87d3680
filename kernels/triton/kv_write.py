"""Write a step's keys and values into the paged KV pool, each row at its slot.

kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (one layer's view)
row t  -> kv_layer[slot_blocks[t], 0 | 1, slot_offsets[t]] = k[t] | v[t]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    pool_ptr,
    blocks_ptr,
    offsets_ptr,
    head_dim,
    s_block,
    s_kv,
    s_off,
    s_head,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    src = (row * num_heads + head) * head_dim + d
    block = tl.load(blocks_ptr + row).to(tl.int64)
    off = tl.load(offsets_ptr + row).to(tl.int64)
    dst = pool_ptr + block * s_block + off * s_off + head * s_head + d
    tl.store(dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(dst + s_kv, tl.load(v_ptr + src, mask=mask), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """k, v: [T, num_kv_heads, head_dim] contiguous; slot_blocks, slot_offsets: [T] ints."""
    assert k.shape == v.shape and k.is_contiguous() and v.is_contiguous(), "k, v: [T, Hkv, D]"
    t, num_kv_heads, head_dim = k.shape
    assert kv_layer.dim() == 5 and kv_layer.shape[1] == 2, "kv_layer: [N, 2, bs, Hkv, D]"
    assert kv_layer.shape[3:] == (num_kv_heads, head_dim) and kv_layer.stride(4) == 1
    assert kv_layer.dtype == k.dtype == v.dtype
    assert slot_blocks.shape == slot_offsets.shape == (t,)
    if t:
        _write_kv_kernel[(t, num_kv_heads)](
            k,
            v,
            kv_layer,
            slot_blocks,
            slot_offsets,
            head_dim,
            kv_layer.stride(0),
            kv_layer.stride(1),
            kv_layer.stride(2),
            kv_layer.stride(3),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )


def write_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    kv_layer[slot_blocks, :, slot_offsets] = torch.stack((k, v), dim=1)  # [T, 2, Hkv, D]
