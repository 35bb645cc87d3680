"""Tensor parallelism applied from outside the model, as gpt-fast does it: `apply_tp(model,
rank, world)` keeps this rank's share of every weight and swaps in the few modules that
talk to the other ranks. The model itself stays plain single-device code.

    every rank r of `world`, per decoder layer (x is the same on every rank):

      x [T, hidden] -> qkv_proj  column-parallel: heads [r*Hq/w, (r+1)*Hq/w) of q and
                                 their kv heads [r*Hkv/w, (r+1)*Hkv/w) of k and v
                    -> attention over this rank's own KV pool (Hkv/w heads)
                    -> o_proj    row-parallel: this rank's columns, a partial sum
                    -> all-reduce (sum)                                  -> [T, hidden]
                    -> gate_up   column-parallel: intermediate/w of gate and of up
                    -> down      row-parallel: a partial sum
                    -> all-reduce (sum)                                  -> [T, hidden]

      embed_tokens  vocab-parallel: rows [r*V/w, (r+1)*V/w); a token outside them reads
                    zeros, and an all-reduce fills in every token's row
      lm_head       vocab-parallel: this rank's logits columns, all-gathered to [T, vocab]

So a step costs two all-reduces per layer, one for the embedding and one all-gather of
the logits of the rows that are sampled. Query heads go with their kv heads (contiguous
slices keep GQA's head grouping), which is why `world` must divide both head counts.
Mixture-of-Experts layers split every expert's MLP the same way; the router stays whole
on every rank, so each rank picks the same experts, and the block is reduced once. Under
expert parallelism they are left whole here, for tokenyard.models.expert_parallel to place.

Weight-only quantization is applied after this, to each rank's slices (quantize() walks
into the wrappers): int8's per-channel and int4's per-group scales are then those of the
slice, a slightly different rounding from one rank's (same schemes, same error bounds).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenyard.models.config import ModelConfig
from tokenyard.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from tokenyard.models.mlp import MLP
from tokenyard.models.module import LeanModule
from tokenyard.models.moe import SparseMoeBlock
from tokenyard.models.quantize import fp32_linear

ProcessGroup = Any  # torch.distributed.ProcessGroup; None = the default group


def check_tp(config: ModelConfig, world: int) -> None:
    """Raise ValueError unless `world` ranks can split this model's heads and MLPs evenly."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world}")
    # NOTE: vLLM replicates KV heads when tp > num_kv_heads; we refuse instead (a replicated
    # head costs its KV on every rank, and no model we serve needs it).
    for what, n in (
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_key_value_heads),
        ("intermediate_size", config.intermediate_size),
        ("moe_intermediate_size", config.moe_intermediate_size),
        ("shared_expert_intermediate_size", config.shared_expert_intermediate_size),
    ):
        if n % world:
            raise ValueError(
                f"tensor_parallel_size {world} must divide the model's {what} ({n}): each "
                f"rank holds an equal share; choose a size that divides "
                f"{config.num_attention_heads} query heads and {config.num_key_value_heads} "
                "KV heads"
            )


class AllReduce(LeanModule):
    """Runs `inner` on this rank's shard of the weights and sums the partial outputs."""

    def __init__(self, inner: nn.Module, group: ProcessGroup = None) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args: Any) -> torch.Tensor:
        y = self.inner(*args)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(LeanModule):
    """This rank's rows of the embedding table; every token's row summed in from its owner."""

    def __init__(self, weight: torch.Tensor, start: int, group: ProcessGroup = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [vocab / world, hidden]
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        x.masked_fill_(outside[:, None], 0.0)
        dist.all_reduce(x, group=self.group)
        return x


class GatherVocab(LeanModule):
    """The output projection over this rank's vocabulary rows; logits all-gathered."""

    def __init__(
        self, lm_head: nn.Linear, vocab_size: int, world: int, group: ProcessGroup = None
    ) -> None:
        super().__init__()
        # NOTE: named lm_head so that quantize() keeps it int8, as it does on one rank.
        self.lm_head = lm_head
        self.vocab_size = vocab_size
        self.world = world
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> fp32 logits [T, vocab]."""
        local = fp32_linear(self.lm_head, x).contiguous()  # [T, padded vocab / world]
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


def apply_tp(
    model: nn.Module,
    rank: int,
    world: int,
    group: ProcessGroup = None,
    shard_experts: bool = True,
) -> nn.Module:
    """Keep rank `rank`'s share of a loaded LlamaForCausalLM's weights, in place.
    `shard_experts=False` leaves sparse layers whole, for expert parallelism to place
    (tokenyard.models.expert_parallel)."""
    assert isinstance(model, LlamaForCausalLM)
    check_tp(model.config, world)
    if world == 1:
        return model
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, Attention)
        _shard_attention(layer.self_attn, rank, world)
        # NOTE: wrappers swapped in where gpt-fast registers forward hooks: LeanModule skips
        # hooks on the hot path. The layer calls them as it called the plain ones.
        swap: Any = layer
        swap.self_attn = AllReduce(layer.self_attn, group)
        if shard_experts or not isinstance(layer.mlp, SparseMoeBlock):
            _shard_feed_forward(layer.mlp, rank, world)
            swap.mlp = AllReduce(layer.mlp, group)
    _shard_vocab(model, rank, world, group)
    return model


def _shard_attention(attn: Attention, rank: int, world: int) -> None:
    hq, hkv, d = attn.num_heads // world, attn.num_kv_heads // world, attn.head_dim
    q_size, kv_size = attn.num_heads * d, attn.num_kv_heads * d

    def mine(t: torch.Tensor) -> torch.Tensor:  # rows of the fused [q | k | v] output
        q, k, v = t.split((q_size, kv_size, kv_size))
        return torch.cat(
            [
                q[rank * hq * d : (rank + 1) * hq * d],
                k[rank * hkv * d : (rank + 1) * hkv * d],
                v[rank * hkv * d : (rank + 1) * hkv * d],
            ]
        )

    _keep(attn.qkv_proj, out_rows=mine)
    _keep(attn.o_proj, in_cols=lambda w: _chunk(w, rank, world, dim=1))
    attn.num_heads, attn.num_kv_heads = hq, hkv
    attn.split = (hq * d, hkv * d, hkv * d)


def _shard_feed_forward(ffn: nn.Module, rank: int, world: int) -> None:
    if isinstance(ffn, SparseMoeBlock):  # the router and the shared gate stay whole
        for expert in ffn.experts:
            _shard_feed_forward(expert, rank, world)
        if ffn.shared_expert is not None:
            _shard_feed_forward(ffn.shared_expert, rank, world)
        return
    assert isinstance(ffn, MLP)

    def mine(w: torch.Tensor) -> torch.Tensor:  # rows of the fused [gate | up] output
        gate, up = w.chunk(2)
        return torch.cat([_chunk(gate, rank, world), _chunk(up, rank, world)])

    _keep(ffn.gate_up_proj, out_rows=mine)
    _keep(ffn.down_proj, in_cols=lambda w: _chunk(w, rank, world, dim=1))


def _shard_vocab(model: Any, rank: int, world: int, group: ProcessGroup) -> None:
    vocab = model.config.vocab_size
    tied = model.lm_head.weight is model.embed_tokens.weight
    per_rank = -(-vocab // world)  # the last rank's rows are padded with zeros
    embed = VocabParallelEmbedding(
        _vocab_rows(model.embed_tokens.weight, rank, per_rank), rank * per_rank, group
    )
    head = nn.Linear(model.config.hidden_size, per_rank, bias=False, device="meta")
    head.weight = (
        embed.weight
        if tied
        else nn.Parameter(_vocab_rows(model.lm_head.weight, rank, per_rank), requires_grad=False)
    )
    model.embed_tokens = embed
    model.lm_head = GatherVocab(head, vocab, world, group)


def _vocab_rows(w: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    rows = w[rank * per_rank : (rank + 1) * per_rank]
    pad = per_rank - rows.shape[0]
    return torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]) if pad else rows.clone()


def _chunk(w: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    return w.chunk(world, dim=dim)[rank]


def _keep(linear: nn.Linear, out_rows: Any = None, in_cols: Any = None) -> None:
    """Replace a Linear's weight (and bias) by this rank's rows or columns of it."""
    w = linear.weight.detach()
    w = out_rows(w) if out_rows else in_cols(w)
    # NOTE: copies, not views: a view would keep the whole unsharded tensor alive.
    linear.weight = nn.Parameter(
        w.clone(memory_format=torch.contiguous_format), requires_grad=False
    )
    if linear.bias is not None and out_rows:
        linear.bias = nn.Parameter(out_rows(linear.bias.detach()).clone(), requires_grad=False)
    # a row-parallel bias would be added once per rank; no model we load has one there
    assert linear.bias is None or out_rows, "row-parallel layers must not have a bias"
    linear.out_features, linear.in_features = w.shape
