"""Sparse Mixture-of-Experts feed-forward layers: Mixtral's and Qwen2-MoE's.

Each token's router scores pick `top_k` of `num_experts` SwiGLU experts; the token's output
is their outputs weighted by the router's softmax probabilities (renormalized over the
chosen experts for Mixtral, and for Qwen2-MoE when its config says `norm_topk_prob`).
Qwen2-MoE adds a shared expert every token goes through, scaled by sigmoid(its own gate).

    x [T, H] --router--> probs [T, E] --top_k--> (ids [T, k], weights [T, k])
    for each expert e hit by some token:  out[rows of e] += w * expert_e(x[rows of e])

The router and the shared expert's gate stay plain parameters, not nn.Linear, so
`quantize()` leaves them in full precision: routing decisions are discrete, and a
quantization error there changes which experts run, not just how precisely. For the same
reason deterministic mode (`batch_invariant`) scores them one token at a time: a dense matmul
of many rows may take another kernel than one row, and its last bits (fp32 and bf16 alike)
then depend on the step's row count, which can flip a close top-k choice.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenyard.models.config import ModelConfig
from tokenyard.models.mlp import MLP
from tokenyard.models.module import LeanModule


class SparseMoeBlock(LeanModule):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, experts = config.hidden_size, config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.router = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)
        self.experts = nn.ModuleList(
            MLP(hidden, config.moe_intermediate_size) for _ in range(experts)
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Parameter | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(hidden, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Parameter(torch.empty(1, hidden), requires_grad=False)
        # Tokens routed to each expert since the engine started (load balance); not a weight.
        self.tokens_per_expert = torch.zeros(experts, dtype=torch.long, device="cpu")
        self.batch_invariant = False  # deterministic mode: gates scored row by row

    def forward(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `prompt` as MLP.forward takes it."""
        weights, ids = self.route(x)  # [T, k] each
        self.count(ids)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = self.expert(e)(x[rows], prompt) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
        if self.shared_expert is not None:
            out += self.shared_output(x, prompt)
        return out

    def count(self, ids: torch.Tensor) -> None:
        """Add a step's routing (ids [T, k]) to the tokens each expert took."""
        self.tokens_per_expert += torch.bincount(
            ids.flatten(), minlength=len(self.tokens_per_expert)
        )

    def shared_output(self, x: torch.Tensor, prompt: bool) -> torch.Tensor:
        """The shared expert's output scaled by its gate: x [T, hidden] -> [T, hidden]."""
        assert self.shared_expert is not None and self.shared_expert_gate is not None
        gate = torch.sigmoid(self._scores(x, self.shared_expert_gate))  # [T, 1]
        return gate * self.shared_expert(x, prompt)

    def _scores(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] @ gate [G, hidden].T -> [T, G]; row by row when batch-invariant."""
        if self.batch_invariant and x.shape[0] > 1:
            return torch.cat([F.linear(row, gate) for row in x.split(1)])
        return F.linear(x, gate)

    def expert(self, e: int) -> MLP:
        return cast(MLP, self.experts[e])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(self._scores(x, self.router).float(), dim=-1)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def load_weights(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        """HF names: Mixtral's `block_sparse_moe.{gate, experts.E.w1/w2/w3}` or Qwen2-MoE's
        `mlp.{gate, experts.E.*_proj, shared_expert.*_proj, shared_expert_gate}`."""
        if prefix + "block_sparse_moe.gate.weight" in weights:
            p = prefix + "block_sparse_moe."
            self.router.copy_(weights[p + "gate.weight"])
            for e in range(len(self.experts)):
                w = [weights[f"{p}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2")]
                self.expert(e).load(*w)
            return
        p = prefix + "mlp."
        self.router.copy_(weights[p + "gate.weight"])
        for e in range(len(self.experts)):
            self.expert(e).load(*_swiglu(weights, f"{p}experts.{e}."))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            self.shared_expert.load(*_swiglu(weights, p + "shared_expert."))
            self.shared_expert_gate.copy_(weights[p + "shared_expert_gate.weight"])


def _swiglu(weights: dict[str, torch.Tensor], p: str) -> list[torch.Tensor]:
    return [weights[f"{p}{n}_proj.weight"] for n in ("gate", "up", "down")]


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
