"""Expert parallelism's placement balancer (pure) and the settings it is refused with; the
2-rank runs against HF are in tests/integration/test_expert_parallel.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenyard.engine.config import EngineConfig
from tokenyard.models.config import ModelConfig
from tokenyard.models.expert_parallel import check_ep
from tokenyard.models.expert_placement import (
    imbalance,
    initial_placement,
    rank_loads,
    rebalance,
    replica_counts,
)

# A router skewed towards two of 8 experts: they take 60% of the tokens.
SKEWED = [300, 300, 60, 60, 50, 50, 40, 40]


def test_initial_placement_gives_each_rank_its_block_and_spares_of_the_next():
    assert initial_placement(4, 2, 0) == [0, 1, 2, 3]
    assert initial_placement(4, 2, 1) == [0, 1, 2, 2, 3, 0]
    assert replica_counts(initial_placement(8, 4, 2), 8) == [2] * 8


def test_rank_loads_split_an_expert_between_its_replicas():
    assert rank_loads([10, 0, 0, 0], [0, 1, 2, 3], 2) == [10.0, 0.0]
    assert rank_loads([10, 0, 0, 0], [0, 1, 2, 0], 2) == [5.0, 5.0]
    assert imbalance([10.0, 0.0]) == 2.0 and imbalance([0.0, 0.0]) == 1.0


@pytest.mark.parametrize(("world", "redundant"), [(2, 0), (2, 1), (4, 1), (4, 2)])
def test_rebalance_lowers_the_skewed_imbalance_and_keeps_every_expert(world, redundant):
    current = initial_placement(len(SKEWED), world, redundant)
    new = rebalance(SKEWED, current, world)
    assert len(new) == len(current) and min(replica_counts(new, len(SKEWED))) >= 1
    before = imbalance(rank_loads(SKEWED, current, world))
    after = imbalance(rank_loads(SKEWED, new, world))
    assert after < before, (before, after)
    if redundant:  # the spare slots went to the two hot experts first
        assert all(replica_counts(new, 8)[e] >= 2 for e in (0, 1))


def test_spare_slots_reach_perfect_balance_where_replicas_can():
    # 2 hot experts over 4 ranks of 3 slots: each hot one in 4 replicas of 75 tokens
    new = rebalance(SKEWED, initial_placement(8, 4, 1), 4)
    assert imbalance(rank_loads(SKEWED, new, 4)) < 1.1


def test_a_balanced_placement_stays_where_it_is():
    even = [100] * 8
    current = initial_placement(8, 2, 0)
    assert rebalance(even, current, 2) == current  # no copy for nothing


def test_experts_that_stay_on_a_rank_keep_their_slot():
    current = [0, 1, 2, 3]
    new = rebalance([100, 90, 10, 0], current, 2)  # 0 and 1 must part
    kept = sum(a == b for a, b in zip(current, new, strict=True))
    assert kept == 2 and imbalance(rank_loads([100, 90, 10, 0], new, 2)) < 1.1


MIXTRAL = ModelConfig(
    architecture="mixtral",
    vocab_size=32000,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    num_local_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
)


def test_check_ep_wants_experts_that_divide():
    check_ep(MIXTRAL, 2)
    check_ep(MIXTRAL, 4)
    with pytest.raises(ValueError, match="must divide the model's 4 experts"):
        check_ep(MIXTRAL, 3)
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        check_ep(replace(MIXTRAL, architecture="llama", num_local_experts=0), 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 2, "expert_parallel_size": 4}, "choose tensor_parallel_size 1"),
        ({"expert_parallel_size": 2, "quantization": "int8"}, "quantization is not supported"),
        ({"expert_parallel_size": 2, "shared_weights_dir": "w"}, "shared_weights_dir"),
        ({"expert_parallel_size": 0}, "at least 1"),
        ({"expert_rebalance_interval": -1}, "must be >= 0"),
    ],
)
def test_what_ep_does_not_combine_with_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_the_ranks_are_shared_by_tensor_and_expert_parallelism():
    assert EngineConfig(expert_parallel_size=2).world_size == 2
    assert EngineConfig(tensor_parallel_size=2, expert_parallel_size=2).world_size == 2
    assert EngineConfig(tensor_parallel_size=2).world_size == 2
