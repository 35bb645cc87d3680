"""Weight-only quantization, applied to a loaded model by swapping its Linear layers.

The model code stays plain single-device torch; `quantize(model, mode)` replaces each
projection with a quantized copy:

- "int8": int8 weights with one scale per output channel (symmetric, absmax / 127);
- "int4": int4 weights in groups of 32 input channels, each group with a scale and an
  offset (asymmetric). A GGUF Q4_1 tensor (the default model's format) is exactly this
  shape, so its weights come through unchanged but for bf16 rounding of scale and offset.
  The output projection (lm_head) stays int8: it is shared with the embeddings, which GGUF
  files keep at 8 bits or more.

Decoding is bound by the bytes of weights read per step, and torch's weight-only kernels
read fewer bytes, but on a CPU they are slower than a dense bf16 matmul once a step carries
more than a handful of rows. A quantized layer therefore keeps its dense weight too
(`keep_dense`, the default) and uses it for steps of more than `DENSE_ABOVE_ROWS` rows:
decode of a few sequences gets the bandwidth, prefill and big batches get the FLOPs. That
costs memory: the report counts both copies, and the tied lm_head reuses the embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32
DENSE_ABOVE_ROWS = 12  # measured crossover on AVX-512 CPUs: int4 is faster below ~12 rows
MODES = ("int8", "int4")


class QuantizedLinear(nn.Module):
    """A Linear whose weight is kept int8 (per channel) or int4 (per group of 32).

    torch's CPU weight-only kernels are fast only with bf16 activations, so rows are cast
    to bf16 for the matmul and the result back to the input's dtype.
    """

    def __init__(self, linear: nn.Linear, bits: int, keep_dense: bool = True) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.bits = bits
        self.out_features, self.in_features = w.shape
        self.bias = linear.bias
        self.dense = linear.weight if keep_dense else None
        if bits == 8:
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
            self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))  # [out, in]
            self.register_buffer("scales", scale.to(torch.bfloat16))
        elif bits == 4:
            if self.in_features % GROUP_SIZE:
                raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE}, got {self.in_features}")
            groups = w.view(self.out_features, -1, GROUP_SIZE)
            lo, hi = groups.amin(-1), groups.amax(-1)
            scale = ((hi - lo) / 15).clamp(min=1e-8)
            q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
            # torch's layout: w = (q - 8) * scale + zero, scales_and_zeros [in / group, out, 2]
            zero = lo + 8 * scale
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q.view_as(w), 2))
            self.register_buffer("scales", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16))
        else:
            raise ValueError(f"bits must be 8 or 4, got {bits}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.dense is not None and rows.shape[0] > DENSE_ABOVE_ROWS:
            return F.linear(x, self.dense, self.bias)
        y = self._quantized_mm(rows.to(torch.bfloat16).contiguous()).to(x.dtype)
        y = y.reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def _quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return torch._weight_int8pack_mm(x, self.qweight, self.scales)
        return torch._weight_int4pack_mm_for_cpu(x, self.qweight, GROUP_SIZE, self.scales)

    def quantized_bytes(self) -> int:
        """What one small-batch step reads of this layer's weights."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))


def quantize(model: nn.Module, mode: str, keep_dense: bool = True) -> nn.Module:
    """Swap every Linear for a QuantizedLinear; the output projection is int8 in either mode."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}: expected one of {MODES}")
    bits = 8 if mode == "int8" else 4
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, QuantizedLinear(child, 8 if name == "lm_head" else bits, keep_dense))
        else:
            quantize(child, mode, keep_dense)
    return model


def dequantized(layer: nn.Module) -> torch.Tensor:
    """The float weight a layer stands for on its small-batch path (tests compare against it)."""
    if isinstance(layer, QuantizedLinear):
        eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
        return layer._quantized_mm(eye).float().T
    assert isinstance(layer, nn.Linear)
    return layer.weight.detach().float()
