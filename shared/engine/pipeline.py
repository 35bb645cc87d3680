"""Pipeline parallelism: the ranks of one engine in `pp` stages of `tp` ranks each, and the
runner that passes a step's activations from stage to stage in micro-batches.

Ranks are numbered stage-major, so a pipeline of one stage is plain tensor parallelism:

    rank = stage * tp + tp_rank          tp=2, pp=2:   stage 0: ranks 0, 1  (rank 0 = engine)
                                                       stage 1: ranks 2, 3

Tensor parallelism runs inside a stage (its own process group); between stages each rank
sends to the rank of the same tp_rank in the next stage, and the last stage sends its final
hidden rows back to stage 0, which holds the output projection and samples (on rank 0).

A step (every rank has the step's StepPlan from parallel.TensorParallelRanks):

    micro-batches = the plan's spans in `pp` contiguous groups of about equal tokens
    stage 0:    for each mb: embed, its layers, isend (x, residual) --> stage 1
                then for each mb: recv final hidden <-- last stage;  logits of the plan's rows
    stage s>0:  for each mb: recv <-- stage s-1, its layers, isend --> stage s+1
                (the last stage: norm, isend hidden --> stage 0)

Stage 0 computes micro-batch 2 while stage 1 computes micro-batch 1, and so on: within a
step the stages overlap once the first micro-batch is through. A step still waits for its
last micro-batch before sampling (no overlap across steps). The micro-batches are separate
sequences, so none reads KV another writes in the same step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.model_runner import InputSpan, ModelRunner, StepPlan, _prepare, _to_device
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.pp import embed, stage_forward

if TYPE_CHECKING:
    from tokenyard.engine.lora import LoRAManager


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in a tp x pp engine."""

    rank: int
    tp: int = 1
    pp: int = 1

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def next_rank(self) -> int:
        """Where this rank's output goes: the next stage's peer, or stage 0's from the last."""
        return (self.stage + 1) % self.pp * self.tp + self.tp_rank

    @property
    def prev_rank(self) -> int:
        """Where this rank's input comes from (stage 0: the last stage's final hidden rows)."""
        return (self.stage - 1) % self.pp * self.tp + self.tp_rank

    @classmethod
    def of(cls, config: EngineConfig, rank: int) -> RankPlace:
        return cls(rank, config.tensor_parallel_size, config.pipeline_parallel_size)


def stage_tp_group(place: RankPlace) -> Any:
    """This rank's tensor-parallel group: None (the default group) on one stage, else its
    stage's ranks. NOTE: every rank creates every stage's group, in stage order, as
    torch.distributed requires of new_group; call it once per rank at the same point."""
    if place.pp == 1 or place.tp == 1:
        return None
    groups = [
        dist.new_group(list(range(s * place.tp, (s + 1) * place.tp))) for s in range(place.pp)
    ]
    return groups[place.stage]


def micro_batches(spans: list[InputSpan], n: int) -> list[list[InputSpan]]:
    """The spans in at most `n` contiguous groups of about equal token counts: a span goes
    to the group its first token falls in (contiguous, so each group keeps the single-token
    spans first; a long prefill span may leave fewer groups). Every rank computes the same
    groups from the same plan."""
    total = sum(len(sp.token_ids) for sp in spans)
    starts = list(itertools.accumulate((len(sp.token_ids) for sp in spans), initial=0))
    groups: list[list[InputSpan]] = [[] for _ in range(n)]
    for span, start in zip(spans, starts[:-1], strict=True):
        groups[min(n - 1, start * n // max(total, 1))].append(span)
    return [g for g in groups if g]


class PipelineRunner(ModelRunner):
    """One rank's runner in a pipeline of `place.pp` stages: `compute(plan)` runs this
    stage's part of every micro-batch; on stage 0, `run` returns the step's logits."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        place: RankPlace,
        per_token_attention: bool = False,
        broadcast: Callable[[StepPlan], None] | None = None,
    ) -> None:
        super().__init__(model, kv_cache, block_size, per_token_attention, broadcast)
        self.place = place

    def _compute(self, plan: StepPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        groups = micro_batches(plan.spans, self.place.pp)
        if not self.place.first:
            self._middle(groups)
            return self._no_rows(), []
        pending = [self._send(self._first(spans)) for spans in groups]
        hidden = torch.cat([self._recv(spans, 1)[0] for spans in groups])  # [T, hidden]
        for work in pending:
            work.wait()
        logits = [
            self.model.logits(hidden[rows]) if rows else hidden.new_empty(0, 0)
            for rows in plan.logit_rows
        ]
        return hidden, logits

    def forward(self, spans: list[InputSpan]) -> tuple[torch.Tensor, list[int]]:
        raise NotImplementedError("a pipeline stage runs micro-batches: use run() or compute()")

    def _first(self, spans: list[InputSpan]) -> torch.Tensor:
        """Stage 0's part of one micro-batch -> [2, T, hidden]: (x, residual)."""
        input_ids, positions, meta = self._inputs(spans)
        x, residual = stage_forward(
            self.model, embed(self.model, input_ids), None, positions, meta, self.kv_cache
        )
        return torch.stack([x, residual])

    def _middle(self, groups: list[list[InputSpan]]) -> None:
        """A later stage: each micro-batch in, through this stage's layers, and on."""
        pending = []
        for spans in groups:
            x, residual = self._recv(spans, 2)
            _, positions, meta = self._inputs(spans)
            x, residual = stage_forward(self.model, x, residual, positions, meta, self.kv_cache)
            if self.place.last:  # [T, hidden]: the final hidden rows, back to stage 0
                pending.append(self._send(self.model.norm(x, residual)[0][None]))
            else:
                pending.append(self._send(torch.stack([x, residual])))
        for work in pending:
            work.wait()

    def _inputs(self, spans: list[InputSpan]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        input_ids, positions, meta, _ = _prepare(spans, self.block_size, self.per_token_attention)
        if self.kv_cache.device.type != "cpu":
            input_ids, positions, meta = _to_device(
                self.kv_cache.device, input_ids, positions, meta
            )
        return input_ids, positions, meta

    def _send(self, t: torch.Tensor) -> Any:
        return dist.isend(t.contiguous(), dst=self.place.next_rank)

    def _recv(self, spans: list[InputSpan], parts: int) -> torch.Tensor:
        """[parts, T, hidden] of one micro-batch from the previous stage."""
        rows = sum(len(sp.token_ids) for sp in spans)
        buf = self._no_rows().new_empty(parts, rows, self.model.config.hidden_size)
        dist.recv(buf, src=self.place.prev_rank)
        return buf

    def _no_rows(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.model.norm.weight.dtype, device=self.kv_cache.device)


def make_runner(
    config: EngineConfig,
    model: LlamaForCausalLM,
    kv_cache: torch.Tensor,
    rank: int = 0,
    broadcast: Callable[[StepPlan], None] | None = None,
    lora: LoRAManager | None = None,
) -> ModelRunner:
    """Rank `rank`'s runner: a PipelineRunner where the engine has several stages (LoRA
    adapters run on one rank only: EngineConfig refuses them with stages)."""
    if config.pipeline_parallel_size == 1:
        return ModelRunner(
            model, kv_cache, config.block_size, config.deterministic, broadcast, lora=lora
        )
    return PipelineRunner(
        model,
        kv_cache,
        config.block_size,
        RankPlace.of(config, rank),
        config.deterministic,
        broadcast,
    )
