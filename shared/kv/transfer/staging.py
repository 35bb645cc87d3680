"""Host blocks a hand-off passes through when the engine's own pool cannot be served or
pulled into directly: a tensor-parallel engine's pool holds one rank's KV heads, while
transfers carry every head (kv/tp_layout.py).

    prefill worker: engine.read_kv_blocks(held) -> staging[ids] --- served by KVTransferServer
    decode worker:  KVTransferClient.pull -> staging[ids] -> engine.write_kv_blocks(imported)

Staging ids are taken and given back last-in first-out, so the same few blocks are reused
and only as much of the pool becomes resident as hand-offs in flight at once use.
"""

from __future__ import annotations

import torch

from tokenyard.kv.layout import KVLayout
from tokenyard.kv.transfer.common import copy_blocks
from tokenyard.kv.transfer.shm import allocate_shared_pool


class StagingPool:
    def __init__(self, layout: KVLayout, num_blocks: int, *, shared_memory: bool) -> None:
        """``shared_memory``: allocate the pool in /dev/shm, so that a decode worker on this
        host copies straight from it (a prefill worker's)."""
        assert layout.tp_size == 1, "staged blocks hold every KV head"
        self.layout = layout
        if shared_memory:
            self.pool, _ = allocate_shared_pool(layout, num_blocks)
        else:  # NOTE: not zeroed: torch.empty's pages become resident only once written
            self.pool = torch.empty(layout.pool_shape(num_blocks), dtype=layout.torch_dtype)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest first
        self._taken: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """``n`` staging blocks, or None when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._taken.update(ids)
        return ids

    def give_back(self, ids: list[int]) -> None:
        assert self._taken.issuperset(ids), "a staging block given back twice"
        self._taken.difference_update(ids)
        self._free.extend(reversed(ids))

    def read(self, ids: list[int]) -> torch.Tensor:
        """A copy of the staged blocks: [len(ids), *layout.block_shape]."""
        out = torch.empty(self.layout.pool_shape(len(ids)), dtype=self.pool.dtype)
        if ids:
            copy_blocks(self.pool, out, ids, range(len(ids)))
        return out

    def write(self, ids: list[int], blocks: torch.Tensor) -> None:
        if ids:
            copy_blocks(blocks.contiguous(), self.pool, range(len(ids)), ids)
