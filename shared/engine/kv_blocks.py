"""The engine's KV blocks as they cross its boundary (hand-offs, the KV-cache service):
host copies in the whole-head layout, whatever the engine's tensor-parallel size.

    one rank:  read(ids)  = pool[ids], copied out
               write(ids, blocks): pool[ids] = blocks
    N ranks (rank 0 is the engine; each rank's pool holds Hkv/N heads, kv/tp_layout.py):
      read(ids)           broadcast(GatherKV(ids)); every rank copies out its pool[ids];
                          gather on rank 0; merge_heads -> [n, layers, 2, block_size, Hkv, D]
      write(ids, blocks)  broadcast(ScatterKV(ids)); split_heads(blocks) on rank 0;
                          scatter; every rank: pool[ids] = its share

The collectives run on the plan group (gloo, on the host) over raw bytes: a GPU rank copies
its share to the host first, and gloo need not support the KV dtype (fp8 included). A call
runs between two steps, as plans do, so every rank has finished the steps that wrote them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenyard.engine.model_runner import ModelRunner
from tokenyard.engine.parallel import RankCall, TensorParallelRanks
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.tp_layout import merge_heads, split_heads
from tokenyard.kv.transfer.common import copy_blocks


class KVBlocks:
    """Rank 0's access to the engine's blocks, every rank's heads together."""

    def __init__(
        self, pool: torch.Tensor, layout: KVLayout, ranks: TensorParallelRanks | None
    ) -> None:
        self.pool = pool  # this rank's: [num_blocks, layers, 2, block_size, Hkv / N, D]
        self.layout = layout.whole_heads()  # the blocks read and written here
        self.ranks = ranks

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of the blocks: [len(block_ids), layers, 2, block_size, Hkv, D]."""
        ids = list(block_ids)
        if self.ranks is None or not ids:
            return _copy_out(self.pool, ids)
        self.ranks.broadcast(GatherKV(ids))
        return merge_heads(_gather(self.pool, ids, self.ranks.plan_group))

    def write(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write whole-head blocks into the pools' blocks ``block_ids`` (each rank its heads)."""
        ids = list(block_ids)
        want = self.layout.pool_shape(len(ids))
        if tuple(blocks.shape) != want or blocks.dtype != self.layout.torch_dtype:
            raise ValueError(
                f"blocks {tuple(blocks.shape)} {blocks.dtype} are not {want} {self.layout.dtype}"
            )
        if self.ranks is None or not ids:
            _copy_in(self.pool, ids, blocks)
            return
        self.ranks.broadcast(ScatterKV(ids))
        world = dist.get_world_size(self.ranks.plan_group)
        _scatter(self.pool, ids, split_heads(blocks, world), self.ranks.plan_group)


@dataclass(frozen=True)
class GatherKV(RankCall):
    """Every other rank's half of KVBlocks.read: send its share of the blocks to rank 0."""

    block_ids: list[int]

    def run(self, runner: ModelRunner, group: Any) -> None:
        _gather(runner.kv_cache, self.block_ids, group)


@dataclass(frozen=True)
class ScatterKV(RankCall):
    """Every other rank's half of KVBlocks.write: take its share from rank 0."""

    block_ids: list[int]

    def run(self, runner: ModelRunner, group: Any) -> None:
        _scatter(runner.kv_cache, self.block_ids, None, group)


def _gather(pool: torch.Tensor, ids: list[int], group: Any) -> list[torch.Tensor]:
    """Every rank's share of the blocks on rank 0 (rank order); [] on the other ranks."""
    mine = _copy_out(pool, ids)
    raw = mine.view(torch.uint8)  # gloo moves bytes of any dtype
    if dist.get_rank(group) != 0:
        dist.gather(raw, None, dst=0, group=group)
        return []
    parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.gather(raw, parts, dst=0, group=group)
    return [p.view(pool.dtype) for p in parts]


def _scatter(
    pool: torch.Tensor, ids: list[int], shares: list[torch.Tensor] | None, group: Any
) -> None:
    """Rank 0 sends each rank its share (``shares``, rank order; None elsewhere)."""
    share = torch.empty((len(ids), *pool.shape[1:]), dtype=pool.dtype)
    raw = [s.view(torch.uint8) for s in shares] if shares is not None else None
    dist.scatter(share.view(torch.uint8), raw, src=0, group=group)
    _copy_in(pool, ids, share)


def _copy_out(pool: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """pool[ids] as a new contiguous host tensor."""
    if not ids:
        return torch.empty((0, *pool.shape[1:]), dtype=pool.dtype)
    if pool.device.type != "cpu":
        return pool[torch.tensor(ids, dtype=torch.long, device=pool.device)].cpu()
    out = torch.empty((len(ids), *pool.shape[1:]), dtype=pool.dtype)
    copy_blocks(pool, out, ids, range(len(ids)))
    return out


def _copy_in(pool: torch.Tensor, ids: list[int], blocks: torch.Tensor) -> None:
    """pool[ids] = blocks (a host tensor of len(ids) blocks)."""
    if not ids:
        return
    if pool.device.type != "cpu":
        pool[torch.tensor(ids, dtype=torch.long, device=pool.device)] = blocks.to(pool.device)
        return
    copy_blocks(blocks.contiguous(), pool, range(len(ids)), ids)
