"""Fused residual add + RMSNorm: out = rms_norm(x + residual) * weight, and the sum itself."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, dim, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the input dtype before the norm, as the twin rounds it.
        x = (x + tl.load(res_ptr + row * dim + cols, mask=mask, other=0.0)).to(x.dtype)
        tl.store(res_ptr + row * dim + cols, x, mask=mask)  # the residual becomes the sum
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / dim + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); the sum is written into ``residual``.

    x, residual: [T, dim] contiguous, same dtype; weight: [dim]."""
    assert x.dim() == 2 and x.is_contiguous(), "x: [T, dim], contiguous"
    t, dim = x.shape
    assert weight.shape == (dim,) and weight.is_contiguous()
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
        assert residual.dtype == x.dtype
    out = torch.empty_like(x)
    if t:
        _add_rms_norm_kernel[(t,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out, (residual if residual is not None else x)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: the same rounding as Hugging Face's Llama RMSNorm."""
    summed = x if residual is None else x + residual
    h = summed.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(summed.dtype), summed
