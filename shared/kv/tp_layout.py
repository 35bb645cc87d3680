"""Converting KV blocks between the whole-head layout and tensor-parallel ranks' shares.

A tensor-parallel engine of `world` ranks keeps, on rank r, the KV heads
[r * Hkv/world, (r + 1) * Hkv/world) of every block (tokenyard.models.tp splits qkv_proj
that way). Blocks leave and enter an engine only with all heads together, so two engines of
any tensor-parallel sizes (and the KV-cache service, which knows none) exchange them as is:

    whole-head blocks  [n, layers, 2, block_size, Hkv, D]       (KVLayout.whole_heads())
         | split_heads(blocks, 2)              ^ merge_heads([rank 0's, rank 1's])
         v                                     |
    rank 0: [n, layers, 2, block_size, Hkv/2, D]   heads 0 .. Hkv/2 - 1
    rank 1: [n, layers, 2, block_size, Hkv/2, D]   heads Hkv/2 .. Hkv - 1
"""

from __future__ import annotations

import torch

HEAD_DIM = 4  # the KV-head dimension of a stack of blocks [n, layers, 2, block_size, Hkv, D]


def split_heads(blocks: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Each rank's share of whole-head blocks, contiguous (rank order)."""
    heads = blocks.shape[HEAD_DIM]
    if heads % world:
        raise ValueError(f"{heads} KV heads do not split over {world} ranks")
    return [part.contiguous() for part in blocks.chunk(world, dim=HEAD_DIM)]


def merge_heads(shares: list[torch.Tensor]) -> torch.Tensor:
    """Whole-head blocks from every rank's share (rank order)."""
    return torch.cat(shares, dim=HEAD_DIM)
