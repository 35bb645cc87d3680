"""The SwiGLU feed-forward block, dense layers' MLP and each MoE expert alike."""

from __future__ import annotations

import torch
from torch import nn

from tokenyard.models.fused import silu_and_mul
from tokenyard.models.module import LeanModule
from tokenyard.models.quantize import gate_up_silu, project


class MLP(LeanModule):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `prompt`: the step carries prompt tokens (a
        quantized projection may then take another kernel: LinearKernel.dense_step)."""
        act = gate_up_silu(self.gate_up_proj, x, prompt)  # one kernel call where it pays (AMX)
        if act is None:
            act = silu_and_mul(project(self.gate_up_proj, x, prompt))
        return project(self.down_proj, act, prompt)

    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up_proj.weight.copy_(torch.cat([gate, up]))
        self.down_proj.weight.copy_(down)
