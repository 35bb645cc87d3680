"""Expert parallelism applied from outside the model, as tp.py applies tensor parallelism:
`apply_ep(model, rank, world)` keeps this rank's experts of every sparse layer and swaps in
a block that sends tokens to the ranks holding their experts and gathers the results back.

The ranks are the tensor-parallel ranks (EngineConfig.world_size): attention is sharded by
tensor parallelism (or, at tensor_parallel_size 1, replicated), so every rank enters the
sparse layer with the same x. Each rank is the home of an equal share of the rows:

    every rank r of `world`, per sparse layer (x [T, hidden] the same on every rank):

      route all T rows (the router is whole on every rank: [E, hidden])  -> ids, weights [T, k]
      rows [r*m, (r+1)*m) are r's, m = ceil(T / world); each (row, choice) pair goes to a
        replica of its expert: slot = replicas[e][row % num_replicas[e]], rank = slot // S
      all-to-all: pair counts, then x rows and local slot ids   (dispatch)
      run each local slot's expert on the rows it received
      all-to-all: expert outputs back to the rows' home ranks    (combine)
      home rank: out[row] += weight * output; all-gather the ranks' rows -> [T, hidden]
      + the shared expert (Qwen2-MoE), whole on every rank, on all T rows

NOTE: every rank routes every row although it dispatches only its own: the router is
E x hidden (cheap), and rank 0's `tokens_per_expert` then counts every token, which is what
the engine's statistics and the placement balancer (expert_placement.rebalance) read.
torch.distributed.all_to_all_single carries the dispatch on gloo (CPU) and NCCL (GPU) alike.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tokenyard.models.config import ModelConfig
from tokenyard.models.expert_placement import Placement, initial_placement, replica_counts
from tokenyard.models.mlp import MLP
from tokenyard.models.module import LeanModule
from tokenyard.models.moe import SparseMoeBlock

ProcessGroup = Any  # torch.distributed.ProcessGroup; None = the default group


def check_ep(config: ModelConfig, world: int) -> None:
    """Raise ValueError unless `world` ranks can take an equal share of the experts."""
    if world < 1:
        raise ValueError(f"expert_parallel_size must be at least 1, got {world}")
    if world > 1 and not config.num_local_experts:
        raise ValueError(
            f"expert_parallel_size {world} needs a Mixture-of-Experts model; this one has no "
            "experts (use tensor_parallel_size)"
        )
    if config.num_local_experts % world:
        raise ValueError(
            f"expert_parallel_size {world} must divide the model's {config.num_local_experts} "
            "experts: each rank holds an equal share"
        )


class ExpertParallelMoE(LeanModule):
    """A SparseMoeBlock whose experts are spread over the ranks; `block.experts` holds this
    rank's slots (see the module's docstring for the dispatch and the combine)."""

    def __init__(
        self,
        block: SparseMoeBlock,
        slots: Placement,
        rank: int,
        world: int,
        group: ProcessGroup = None,
    ) -> None:
        super().__init__()
        self.block = block
        self.rank, self.world, self.group = rank, world, group
        self.num_experts = len(block.tokens_per_expert)
        self.slots_per_rank = len(slots) // world
        assert self.slots_per_rank * world == len(slots)
        taken: set[int] = set()
        local = []
        for e in self.local_experts(slots):  # a second slot of one expert gets its own copy
            local.append(block.expert(e) if e not in taken else copy.deepcopy(block.expert(e)))
            taken.add(e)
        block.experts = nn.ModuleList(local)  # the other experts' weights are freed
        # (row, expert) pairs each rank ran since the engine started (its load); not a weight
        self.tokens_per_rank = torch.zeros(world, dtype=torch.long)
        self.set_slots(slots)

    def local_experts(self, slots: Placement) -> list[int]:
        s = self.slots_per_rank
        return slots[self.rank * s : (self.rank + 1) * s]

    def set_slots(self, slots: Placement) -> None:
        """Point the dispatch at `slots` (the weights must already be where it says)."""
        self.slots = list(slots)
        counts = replica_counts(self.slots, self.num_experts)
        assert min(counts) >= 1, "every expert needs a slot"
        table = torch.zeros(self.num_experts, max(counts), dtype=torch.long)
        filled = [0] * self.num_experts
        for p, e in enumerate(self.slots):
            table[e, filled[e]] = p
            filled[e] += 1
        self._replica_table = table  # [E, max replicas]: physical slots of each expert
        self._num_replicas = torch.tensor(counts, dtype=torch.long)  # [E]

    def forward(self, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """x: [T, hidden], the same on every rank -> [T, hidden], the same on every rank."""
        block = self.block
        weights, ids = block.route(x)  # [T, k] each
        block.count(ids)
        slot = self._slots_of(ids)  # [T * k]: the physical slot of each (row, choice) pair
        self.tokens_per_rank += torch.bincount(slot // self.slots_per_rank, minlength=self.world)
        lo, hi = self._home_rows(x.shape[0])
        k = ids.shape[1]
        out = self._routed(x[lo:hi], weights[lo:hi], slot[lo * k : hi * k], prompt)  # [hi-lo, H]
        out = self._gather_rows(out, x.shape[0])
        if block.shared_expert is not None:
            out += block.shared_output(x, prompt)
        return out

    def _home_rows(self, num_rows: int) -> tuple[int, int]:
        m = -(-num_rows // self.world)
        return min(self.rank * m, num_rows), min((self.rank + 1) * m, num_rows)

    def _slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] -> [T * k] physical slots: row t's replica of its expert is t mod the
        expert's replica count, so the replicas share an expert's rows evenly."""
        expert = ids.flatten().cpu()
        row = torch.arange(expert.numel()) // ids.shape[1]
        return self._replica_table[expert, row % self._num_replicas[expert]]

    def _routed(
        self, x: torch.Tensor, weights: torch.Tensor, slot: torch.Tensor, prompt: bool
    ) -> torch.Tensor:
        """This rank's rows (x [t, H], weights [t, k]) through the experts in their `slot`
        ([t * k]), wherever those live."""
        pair_row = torch.arange(slot.numel()) // weights.shape[1]  # pair i: row i // k
        order = torch.argsort(slot // self.slots_per_rank, stable=True)  # grouped by rank
        send_counts = torch.bincount(slot // self.slots_per_rank, minlength=self.world)
        rows = pair_row[order].to(x.device)
        received, local_slots, recv_counts = self._dispatch(
            x[rows], (slot % self.slots_per_rank)[order], send_counts
        )
        outputs = self._run_local(received, local_slots, prompt)
        back = self._all_to_all(outputs, send_counts.tolist(), recv_counts)  # [P, H]
        out = torch.zeros_like(x)
        out.index_add_(0, rows, back * weights.flatten()[order.to(x.device), None])
        return out

    def _dispatch(
        self, x: torch.Tensor, local_slots: torch.Tensor, send_counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """x rows [P, H] and their slots on the receiving rank -> what this rank received."""
        device = x.device
        recv_counts = torch.empty_like(send_counts, device=device)
        dist.all_to_all_single(recv_counts, send_counts.to(device), group=self.group)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        slots = self._all_to_all(local_slots.to(device), recvs, sends)
        return self._all_to_all(x, recvs, sends), slots, recvs

    def _all_to_all(self, t: torch.Tensor, recvs: list[int], sends: list[int]) -> torch.Tensor:
        out = t.new_empty(sum(recvs), *t.shape[1:])
        dist.all_to_all_single(out, t.contiguous(), recvs, sends, group=self.group)
        return out

    def _run_local(self, x: torch.Tensor, slots: torch.Tensor, prompt: bool) -> torch.Tensor:
        """Each local slot's expert once, on all the rows sent to it."""
        out = torch.empty_like(x)
        for s in slots.unique().tolist():
            rows = (slots == s).nonzero(as_tuple=True)[0]
            out[rows] = self.block.expert(s)(x[rows], prompt)
        return out

    def _gather_rows(self, mine: torch.Tensor, num_rows: int) -> torch.Tensor:
        m = -(-num_rows // self.world)
        padded = torch.cat([mine, mine.new_zeros(m - mine.shape[0], mine.shape[1])])
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts)[:num_rows]


def apply_ep(
    model: nn.Module, rank: int, world: int, redundant: int = 0, group: ProcessGroup = None
) -> nn.Module:
    """Keep rank `rank`'s experts of every sparse layer of a loaded model, in place; each
    rank gets E / world experts and `redundant` spare slots (expert_placement)."""
    check_ep(model.config, world)  # type: ignore[arg-type]
    if world == 1:
        return model
    for layer in model.layers:  # type: ignore[union-attr]
        if isinstance(layer.mlp, SparseMoeBlock):
            slots = initial_placement(len(layer.mlp.experts), world, redundant)
            layer.mlp = ExpertParallelMoE(layer.mlp, slots, rank, world, group)
    return model


def ep_blocks(model: nn.Module) -> list[ExpertParallelMoE]:
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def move_experts(moe: ExpertParallelMoE, new: Placement) -> int:
    """Copy weights between the ranks so this rank's slots hold `new`'s experts, then
    dispatch by `new`. Every rank calls it with the same `new` (its broadcasts pair up);
    returns how many of this rank's slots were rewritten."""
    old, world, s = moe.slots, moe.world, moe.slots_per_rank
    held = [old[r * s : (r + 1) * s] for r in range(world)]
    wanted = [new[r * s : (r + 1) * s] for r in range(world)]
    mine_old, mine_new = held[moe.rank], wanted[moe.rank]
    # Experts some rank needs and does not hold: sent by the first rank that holds one.
    # NOTE: a broadcast reaches every rank, not only the one that needs it; at world 2 that
    # is the same traffic as a send, and it cannot deadlock on an order of sends.
    arriving: dict[int, list[torch.Tensor]] = {}
    template = list(moe.block.expert(0).parameters())
    for e in sorted({e for r in range(world) for e in wanted[r] if e not in held[r]}):
        src = next(r for r in range(world) if e in held[r])
        local = list(moe.block.expert(held[src].index(e)).parameters()) if src == moe.rank else []
        bufs = [p.detach() for p in local] or [torch.empty_like(p) for p in template]
        for buf in bufs:
            dist.broadcast(buf, src=src, group=moe.group)
        if e in mine_new and e not in mine_old:  # so src is another rank: bufs are fresh
            arriving[e] = bufs
    changed = [i for i in range(s) if mine_old[i] != mine_new[i]]
    # Local sources are read before any slot is overwritten (slots may trade experts).
    for e in {mine_new[i] for i in changed} - arriving.keys():
        arriving[e] = [p.detach().clone() for p in _expert(moe, mine_old.index(e)).parameters()]
    for i in changed:
        for p, t in zip(_expert(moe, i).parameters(), arriving[mine_new[i]], strict=True):
            p.copy_(t)
    moe.set_slots(new)
    return len(changed)


def _expert(moe: ExpertParallelMoE, slot: int) -> MLP:
    return moe.block.expert(slot)
