"""Weight-only quantization, applied to a loaded model by swapping its Linear layers.

The model code stays plain single-device torch; `quantize(model, "int8")` replaces each
projection with an int8 copy and a per-output-channel scale (symmetric, absmax / 127).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    weight: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out]

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # [out]
        self.register_buffer("weight", torch.round(w / scale[:, None]).to(torch.int8))  # [out, in]
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.out_features, self.in_features = w.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(), self.weight, self.scale)
        y = y.reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def quantize(model: nn.Module, mode: str) -> nn.Module:
    if mode != "int8":
        raise ValueError(f"unknown quantization {mode!r}")
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize(child, mode)
    return model


def dequantized(layer: nn.Module) -> torch.Tensor:
    """The float weight a quantized layer stands for (tests compare against it)."""
    if isinstance(layer, Int8Linear):
        assert isinstance(layer.weight, torch.Tensor) and isinstance(layer.scale, torch.Tensor)
        return layer.weight.float() * layer.scale.float()[:, None]
    assert isinstance(layer, nn.Linear)
    return F.linear(torch.eye(layer.in_features, dtype=layer.weight.dtype), layer.weight).T
