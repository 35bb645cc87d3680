"""Pipeline stages applied from outside the model, as `apply_tp` applies tensor parallelism:
`apply_pp(model, stage, num_stages)` keeps one stage's contiguous run of decoder layers
and drops what other stages hold; `stage_forward` runs that stage's part of a step.

    stage 0 of pp                  stage s                       stage pp-1
    embed_tokens, lm_head          (layers only)                 norm
    layers [0, L/pp)       -> (x, residual) ->  layers [..) -> (x, residual) -> layers [.., L)
                                                                 -> norm -> hidden [T, hidden]
    logits of hidden (sampled rows) <------------------------------------'

Each stage's KV pool holds its own layers only, so a kept layer reads its pool at its index
within the stage (`Attention.layer_idx` is renumbered here). The layers between stages
carry two tensors, the layer's output and the residual stream, as the layer loop does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenyard.models.attention import AttnMetadata
from tokenyard.models.config import ModelConfig
from tokenyard.models.llama import Attention, LlamaForCausalLM


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """The layers stage `stage` holds: contiguous, the first `num_layers % num_stages`
    stages one more than the others (5 layers over 2 stages: [0, 3) and [3, 5))."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def check_pp(config: ModelConfig, num_stages: int) -> None:
    """Raise ValueError unless every one of `num_stages` stages gets at least one layer."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {num_stages}")
    if num_stages > config.num_hidden_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} exceeds the model's "
            f"{config.num_hidden_layers} layers: each stage holds at least one layer"
        )


def apply_pp(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Keep stage `stage`'s layers (and the embedding and output projection on stage 0 only)
    of a loaded LlamaForCausalLM, in place."""
    assert isinstance(model, LlamaForCausalLM)
    check_pp(model.config, num_stages)
    if num_stages == 1:
        return model
    kept = stage_layers(len(model.layers), stage, num_stages)
    model.layers = nn.ModuleList(model.layers[i] for i in kept)
    for local, layer in enumerate(model.layers):
        # The attention may sit inside apply_tp's wrapper: find it wherever it is.
        attn = next(m for m in layer.modules() if isinstance(m, Attention))
        attn.layer_idx = local
    if stage > 0:  # NOTE: stage 0 embeds the tokens and turns the last stage's rows to logits
        swap: Any = model
        swap.embed_tokens = nn.Identity()
        swap.lm_head = nn.Identity()
    model.fused_layers = False  # the fused kernel runs a whole model: embedding to norm
    return model


def stage_forward(
    model: LlamaForCausalLM,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    meta: AttnMetadata,
    kv_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This stage's layers over (x, residual) -> (x, residual) for the next stage.

    x: [T, hidden], the embedded tokens on stage 0 (residual None) or the previous stage's
    output; kv_cache: [num_blocks, this stage's layers, 2, block_size, H_kv, D]."""
    assert model.rope is not None, "load_weights() first"
    for layer in model.layers:
        x, residual = layer(x, residual, positions, model.rope, meta, kv_cache)
    assert residual is not None, "every stage holds at least one layer"
    return x, residual


def embed(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Stage 0's input: input_ids [T] -> [T, hidden] in the compute dtype (the table may be
    narrower: engine.memory.compact_embeddings)."""
    return model.embed_tokens(input_ids).to(model.norm.weight.dtype)
