"""LoRA in the model: each adapted projection keeps its base layer and adds low-rank products
for the rows of the step that belong to an adapter, several adapters in one batch.

`apply_lora(model, max_loras, max_rank)` swaps the seven projections of every dense layer
(q/k/v fused, o, gate/up fused, down) for a LoRALinear, the way `quantize` swaps Linear
layers: the model code stays plain. Each LoRALinear holds `max_loras` slots of stacked
weights; an adapter is copied into a slot (`set_slot`) before its rows run, so adapters
beyond the slots wait on the host (engine/lora.py decides which slot holds which).

A fused projection's parts share one A and one B per slot: A is the parts' A matrices side
by side, B is block-diagonal, so one pair of matmuls serves q, k and v (rank padded to
max_rank with zeros):

    x [m, in] @ A[slot] [in, parts * R] -> [m, parts * R] @ B[slot] [parts * R, out]

    B[slot] = | B_q  0    0   |   (rows: q's R, k's R, v's R; columns: q | k | v outputs)
              | 0    B_k  0   |
              | 0    0    B_v |

A step's rows are grouped by adapter (Punica's SGMV in spirit, one pair of matmuls per
adapter present instead of one gather per row: on a CPU a handful of larger matmuls beat
a batched gather). The groups are computed once per step (LoRABatch) and read by every
layer. A step without adapter rows adds nothing and costs one list check per projection;
the fused CPU decoder path (LlamaForCausalLM._fused_plan) runs such steps as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenyard.models.config import ModelConfig
from tokenyard.models.lora_adapter import TARGETS, LoRAAdapter, module_shape
from tokenyard.models.module import LeanModule
from tokenyard.models.quantize import project

if TYPE_CHECKING:
    from tokenyard.models.llama import LlamaForCausalLM

# Our fused layers and their HF parts, in output order.
PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
assert {p for parts in PARTS.values() for p in parts} == TARGETS.keys()


@dataclass
class LoRABatch:
    """This step's rows by adapter slot: (slot, row indices or None for every row). Empty
    when no row of the step has an adapter. `prompt`: the step carries prompt tokens (a
    quantized base layer may pick its kernel by it: quantize.project)."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    prompt: bool = False


class LoRALinear(LeanModule):
    """base(x) + the low-rank products of the adapters in this step's slots."""

    def __init__(
        self,
        base: nn.Module,
        parts: tuple[str, ...],
        config: ModelConfig,
        batch: LoRABatch,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.batch = batch
        self.max_rank = max_rank
        in_size = module_shape(config, parts[0])[0]
        self.out_sizes = [module_shape(config, p)[1] for p in parts]
        ranks = len(parts) * max_rank
        # a: [slots, in, parts * R]; b: [slots, parts * R, out] (block-diagonal per slot)
        self.a = torch.zeros(max_loras, in_size, ranks, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, ranks, sum(self.out_sizes), dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = project(self.base, x, self.batch.prompt)
        for slot, rows in self.batch.groups:
            if rows is None:
                out += (x @ self.a[slot]) @ self.b[slot]
            else:
                out.index_add_(0, rows, (x[rows] @ self.a[slot]) @ self.b[slot])
        return out

    def set_slot(self, slot: int, adapter: LoRAAdapter | None, layer: int) -> None:
        """Copy `adapter`'s weights for this projection into `slot` (None: clear it)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if adapter is None:
            return
        r, col = adapter.rank, 0
        for i, part in enumerate(self.parts):
            pair = adapter.weights.get((layer, part))
            size = self.out_sizes[i]
            if pair is not None:
                a, b = pair  # [r, in], [out, r]
                rows = slice(i * self.max_rank, i * self.max_rank + r)
                self.a[slot][:, rows] = a.t().to(self.a.dtype)
                self.b[slot][rows, col : col + size] = b.t().to(self.b.dtype)
            col += size


def base_layer(layer: nn.Module) -> nn.Module:
    """The projection under a LoRALinear (the layer itself elsewhere)."""
    return layer.base if isinstance(layer, LoRALinear) else layer


def apply_lora(
    model: LlamaForCausalLM, max_loras: int, max_rank: int
) -> list[dict[str, LoRALinear]]:
    """Swap every dense layer's projections for LoRALinear; per layer, {fused name: layer}.
    The model's `lora_batch` is then the LoRABatch the engine fills each step."""
    from tokenyard.models.llama import DecoderLayer  # it imports this module

    config: ModelConfig = model.config
    if config.num_local_experts:
        raise ValueError("LoRA adapters are served on dense models only, not MoE models")
    batch = LoRABatch()
    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    layers = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        owners: dict[str, nn.Module] = {"qkv_proj": layer.self_attn, "o_proj": layer.self_attn}
        owners |= {"gate_up_proj": layer.mlp, "down_proj": layer.mlp}
        swapped = {}
        for name, owner in owners.items():
            lora = LoRALinear(
                getattr(owner, name), PARTS[name], config, batch, max_loras, max_rank, dtype, device
            )
            setattr(owner, name, lora)
            swapped[name] = lora
        layers.append(swapped)
    model.lora_batch = batch
    return layers


def set_slot(layers: list[dict[str, LoRALinear]], slot: int, adapter: LoRAAdapter | None) -> None:
    """Load `adapter` (None: nothing) into `slot` of every adapted projection."""
    for i, projections in enumerate(layers):
        for lora in projections.values():
            lora.set_slot(slot, adapter, i)
