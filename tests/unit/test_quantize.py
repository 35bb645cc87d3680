"""Weight-only int8: the swapped layer computes what its float weights would, within int8's error."""

from __future__ import annotations

import pytest
import torch
from tokenyard.models.quantize import Int8Linear, dequantized, quantize
from torch import nn


def test_int8_linear_matches_float_within_quantization_error():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8
    x = torch.randn(5, 64)
    exact = linear(x)
    rel = (q(x) - exact).norm() / exact.norm()
    assert rel < 0.01
    # the layer is exactly its dequantized weight times x
    assert torch.allclose(q(x), x @ dequantized(q).T + linear.bias, atol=1e-4)


def test_quantize_swaps_every_linear_in_place():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4)))
    quantize(model, "int8")
    assert isinstance(model[0], Int8Linear) and isinstance(model[1][1], Int8Linear)
    with pytest.raises(ValueError):
        quantize(model, "int3")
