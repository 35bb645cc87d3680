"""Deterministic mode's MoE router: a token's scores, and so its experts, do not depend on
how many tokens share its step."""

from __future__ import annotations

import torch

from tokenyard.models.config import ModelConfig
from tokenyard.models.moe import SparseMoeBlock


def block(hidden: int = 256, experts: int = 8) -> SparseMoeBlock:
    config = ModelConfig(
        architecture="qwen2_moe",
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_local_experts=experts,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=32,
    )
    b = SparseMoeBlock(config)
    g = torch.Generator().manual_seed(0)
    b.router.copy_(torch.randn(b.router.shape, generator=g) * 0.02)
    assert b.shared_expert_gate is not None
    b.shared_expert_gate.copy_(torch.randn(b.shared_expert_gate.shape, generator=g))
    return b


def test_batch_invariant_scores_are_each_row_alone_bit_for_bit():
    b = block()
    b.batch_invariant = True
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(1))
    for gate in (b.router, b.shared_expert_gate):
        assert gate is not None
        together = b._scores(x, gate)
        alone = torch.cat([b._scores(x[i : i + 1], gate) for i in range(len(x))])
        assert torch.equal(together, alone)
    weights, ids = b.route(x)
    alone_routes = [b.route(x[i : i + 1]) for i in range(len(x))]
    assert torch.equal(ids, torch.cat([r[1] for r in alone_routes]))
    assert torch.equal(weights, torch.cat([r[0] for r in alone_routes]))
