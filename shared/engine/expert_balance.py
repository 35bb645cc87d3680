"""The expert-placement load balancer's engine side: every `interval` steps, rank 0 reads the
tokens each expert took since the last rebalance, computes a placement per sparse layer
(tokenyard.models.expert_placement.rebalance) and, where it lowers that layer's per-rank
load, sends a Rebalance to the other ranks with the step plans, then runs it itself:

    rank 0: step ... step | Rebalance(placements) --plan group--> every rank
                          | move_experts per layer: weights copied between the ranks
            step ...      | the next step dispatches by the new placement

The engine does not restart and no request waits for more than the copy: the rebalance
runs between two steps, as the plans do, so every rank applies it at the same point.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenyard.engine.model_runner import ModelRunner
from tokenyard.engine.outputs import ExpertBalanceStats
from tokenyard.engine.parallel import RankCall
from tokenyard.models.expert_parallel import ep_blocks, move_experts
from tokenyard.models.expert_placement import Placement, imbalance, rank_loads, rebalance

log = logging.getLogger(__name__)


@dataclass
class Rebalance(RankCall):
    """Every sparse layer's new placement, in the model's order: every rank applies it
    between two steps (rank 0 with apply, the others as a RankCall)."""

    placements: list[Placement]

    def run(self, runner: ModelRunner, group: Any) -> None:
        self.apply(runner.model)

    def apply(self, model: nn.Module) -> None:
        blocks = ep_blocks(model)
        assert len(blocks) == len(self.placements)
        for block, slots in zip(blocks, self.placements, strict=True):
            if slots != block.slots:
                move_experts(block, slots)


@dataclass
class BalanceRecord:
    """One rebalance, per sparse layer: max/mean of the tokens the ranks ran since the last
    one (measured), and of those the window's routing would give them under the placement
    chosen (the balancer's estimate; `after` equals `before`'s estimate where kept)."""

    step: int
    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)


class ExpertBalancer:
    """Rank 0's balancer: counts steps, reads the routing counters, rebalances."""

    def __init__(self, model: nn.Module, interval: int, send: Callable[[Rebalance], None]) -> None:
        self.model = model
        self.blocks = ep_blocks(model)
        self.interval = interval  # 0: only when rebalance() is called
        self.send = send
        self.steps = 0
        self.history: list[BalanceRecord] = []
        self._seen = self._totals()  # the counters when the balancer last looked
        self._placed = self._seen  # the counters when the placement last changed

    def _totals(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(b.block.tokens_per_expert.clone(), b.tokens_per_rank.clone()) for b in self.blocks]

    def after_step(self) -> None:
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            self.rebalance()

    def window(self) -> list[tuple[list[int], list[int]]]:
        """Per sparse layer, since the last rebalance: (tokens each expert took, tokens each
        rank ran)."""
        return [
            ((b.block.tokens_per_expert - experts).tolist(), (b.tokens_per_rank - ranks).tolist())
            for b, (experts, ranks) in zip(self.blocks, self._seen, strict=True)
        ]

    def stats(self) -> ExpertBalanceStats:
        """Per sparse layer, the ranks' max/mean load measured since the placement last
        changed (or the start), and measured in the window the last rebalance read."""
        now = [
            imbalance([float(n) for n in (b.tokens_per_rank - ranks).tolist()])
            for b, (_, ranks) in zip(self.blocks, self._placed, strict=True)
        ]
        last = self.history[-1].before if self.history else []
        return ExpertBalanceStats(now, list(last), len(self.history))

    def rebalance(self) -> BalanceRecord | None:
        """Place the experts for the window's counts; None where no layer gains."""
        window = self.window()
        self._seen = self._totals()
        record = BalanceRecord(self.steps)
        placements = []
        for block, (counts, ran) in zip(self.blocks, window, strict=True):
            slots = rebalance(counts, block.slots, block.world)
            placements.append(slots)
            record.before.append(imbalance([float(n) for n in ran]))
            record.after.append(imbalance(rank_loads(counts, slots, block.world)))
        if all(p == b.slots for p, b in zip(placements, self.blocks, strict=True)):
            return None
        command = Rebalance(placements)
        self.send(command)
        command.apply(self.model)
        self._placed = self._seen
        self.history.append(record)
        log.info(
            "experts rebalanced at step %d: max/mean rank load %s -> %s",
            self.steps,
            [round(x, 3) for x in record.before],
            [round(x, 3) for x in record.after],
        )
        return record
