"""Rotary position embedding (rotate-half layout), in place on a fused q/k/v projection.

qkv row:  [ q head 0 | ... | q head H-1 | k head 0 | ... | k head Hkv-1 | v ... ]
           <---------------- the first num_heads heads are rotated ------>
per head: [x1 (head_dim/2) | x2 (head_dim/2)] -> [x1*cos - x2*sin | x2*cos + x1*sin]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, row_stride, head_dim, half, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    mask = i < half
    pos = tl.load(pos_ptr + row)
    base = qkv_ptr + row * row_stride + head * head_dim
    x1 = tl.load(base + i, mask=mask, other=0.0)
    x2 = tl.load(base + half + i, mask=mask, other=0.0)
    # The tables are fp32; they are rounded to the activations' dtype first, as the twin does.
    t = pos * head_dim + i
    c1 = tl.load(cos_ptr + t, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + t + half, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + t, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + t + half, mask=mask, other=0.0).to(x1.dtype).to(tl.float32)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + i, (a * c1 - b * s1).to(x1.dtype), mask=mask)
    tl.store(base + half + i, (b * c2 + a * s2).to(x1.dtype), mask=mask)


def rotary_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> None:
    """Rotate the first ``num_heads`` heads of each row of qkv ([T, width]) in place.

    positions: [T] ints; cos, sin: fp32 [max_positions, head_dim] contiguous."""
    assert qkv.dim() == 2 and qkv.stride(1) == 1, "qkv: [T, width], unit stride along width"
    assert num_heads * head_dim <= qkv.shape[1] and head_dim % 2 == 0
    assert positions.shape == (qkv.shape[0],)
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.is_contiguous()
    assert cos.dtype == torch.float32 and sin.is_contiguous()
    half = head_dim // 2
    if qkv.shape[0] and num_heads:
        _rotary_kernel[(qkv.shape[0], num_heads)](
            qkv,
            positions,
            cos,
            sin,
            qkv.stride(0),
            head_dim,
            half,
            BLOCK=triton.next_power_of_2(half),
        )


def rotary_torch_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> None:
    x = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(x * c + torch.cat([-x2, x1], dim=-1) * s)
