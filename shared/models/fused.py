"""The decoder's small fused steps: residual add + RMSNorm, RoPE, SiLU-and-multiply.

Each function takes the Triton kernel for CUDA tensors (`tokenyard.kernels.triton`), the
C++ kernel on a CPU where `tokenyard.kernels.cpu` could be built, and otherwise its torch
twin below (which the kernel tests compare against). The twins
round where Hugging Face's Llama rounds, so fp32 results match it to float precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenyard.kernels import cpu as cpu_kernels


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); with no residual, x is the residual.

    x, residual: [T, dim]. The sum may be written into `residual` in place.
    """
    if x.is_cuda:
        from tokenyard.kernels.triton import norm

        return norm.add_rms_norm(x.contiguous(), residual, weight, eps)
    kernels = cpu_kernels.ops_for(x)
    if kernels is not None and x.is_contiguous():
        if residual is None:
            return kernels.add_rms_norm(x, None, weight, eps), x
        return kernels.add_rms_norm(x, residual, weight, eps), residual
    summed = x if residual is None else x + residual
    return rms_norm_torch(summed, weight, eps), summed


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotary_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    head_dim: int,
) -> None:
    """Rotate, in place, the first `num_heads` heads of each row of qkv ([T, width]).

    cos, sin: fp32 [max_positions, head_dim] tables in rotate-half layout.
    """
    if qkv.is_cuda:
        from tokenyard.kernels.triton import rope

        rope.rotary_(qkv, positions, cos, sin, num_heads, head_dim)
        return
    kernels = cpu_kernels.ops_for(qkv)
    if kernels is not None and qkv.stride(1) == 1:
        kernels.rotary(qkv, positions, cos, sin, num_heads, head_dim)
        return
    x = qkv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    c, s = cos[positions].unsqueeze(1).to(x.dtype), sin[positions].unsqueeze(1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    x.copy_(x * c + torch.cat([-x2, x1], dim=-1) * s)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x: [T, 2I]."""
    if x.is_cuda:
        from tokenyard.kernels.triton import activation

        return activation.silu_and_mul(x.contiguous())
    kernels = cpu_kernels.ops_for(x)
    if kernels is not None and x.is_contiguous():
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
