"""Whole-head KV blocks and tensor-parallel ranks' shares (kv/tp_layout.py), and the staging
blocks a tensor-parallel worker's hand-offs pass through (kv/transfer/staging.py)."""

from __future__ import annotations

import pytest
import torch

from tokenyard.kv.layout import KVLayout
from tokenyard.kv.tp_layout import merge_heads, split_heads
from tokenyard.kv.transfer.staging import StagingPool

RANK_LAYOUT = KVLayout("m", "float32", 4, num_layers=2, num_kv_heads=2, head_dim=3, tp_size=2)


def test_the_whole_head_layout_holds_every_ranks_heads():
    whole = RANK_LAYOUT.whole_heads()
    assert (whole.num_kv_heads, whole.tp_size) == (4, 1)
    assert whole.block_nbytes == 2 * RANK_LAYOUT.block_nbytes
    assert whole.whole_heads() == whole


def test_rank_r_gets_the_heads_its_attention_computes():
    """models/tp.py gives rank r the KV heads [r * H/w, (r + 1) * H/w): the same slices."""
    blocks = torch.arange(3 * 2 * 2 * 4 * 4 * 3, dtype=torch.float32).view(3, 2, 2, 4, 4, 3)
    shares = split_heads(blocks, 2)
    assert [tuple(s.shape) for s in shares] == [(3, 2, 2, 4, 2, 3)] * 2
    assert all(s.is_contiguous() for s in shares)
    assert torch.equal(shares[1], blocks[:, :, :, :, 2:4])
    assert torch.equal(merge_heads(shares), blocks)
    assert torch.equal(merge_heads(split_heads(blocks, 4)), blocks)


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="4 KV heads do not split over 3 ranks"):
        split_heads(torch.zeros(1, 2, 2, 4, 4, 3), 3)


def test_staging_blocks_are_reused_last_in_first_out():
    staging = StagingPool(RANK_LAYOUT.whole_heads(), 4, shared_memory=False)
    a = staging.take(3)
    assert a == [0, 1, 2] and staging.take(2) is None  # one left: no partial take
    blocks = torch.randn(RANK_LAYOUT.whole_heads().pool_shape(3))
    staging.write(a, blocks)
    assert torch.equal(staging.read([2, 0]), blocks[[2, 0]])
    staging.give_back(a)
    assert staging.take(2) == [0, 1]  # the ones just written, not untouched memory
    with pytest.raises(AssertionError, match="given back twice"):
        staging.give_back([2])
