"""Pipeline parallelism's bookkeeping without starting ranks: which layers each stage holds,
where each rank sends, how a step's spans split into micro-batches, and what is refused
(the multi-rank runs are in tests/integration/test_pipeline_parallel.py)."""

from __future__ import annotations

import pytest

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.model_runner import InputSpan
from tokenyard.engine.pipeline import RankPlace, micro_batches
from tokenyard.models.pp import stage_layers


def test_stages_hold_contiguous_layers_the_first_ones_one_more():
    assert [stage_layers(5, s, 2) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [stage_layers(30, s, 4) for s in range(4)] == [
        range(0, 8),
        range(8, 16),
        range(16, 23),
        range(23, 30),
    ]
    assert stage_layers(7, 0, 1) == range(7)


def test_ranks_are_stage_major_and_send_to_the_same_tp_rank_of_the_next_stage():
    # tp=2 x pp=3: stage 0 = ranks 0, 1; stage 1 = 2, 3; stage 2 = 4, 5
    places = [RankPlace(r, tp=2, pp=3) for r in range(6)]
    assert [p.stage for p in places] == [0, 0, 1, 1, 2, 2]
    assert [p.tp_rank for p in places] == [0, 1, 0, 1, 0, 1]
    assert [p.next_rank for p in places] == [2, 3, 4, 5, 0, 1]  # the last stage: to stage 0
    assert [p.prev_rank for p in places] == [4, 5, 0, 1, 2, 3]
    assert places[0].first and places[5].last and not places[2].first and not places[2].last


def _spans(*lengths: int) -> list[InputSpan]:
    return [InputSpan(list(range(n)), 0, [0]) for n in lengths]


def test_micro_batches_split_by_tokens_keep_order_and_leave_none_empty():
    decodes = _spans(1, 1, 1, 1, 1, 1)
    assert [len(g) for g in micro_batches(decodes, 2)] == [3, 3]
    assert [len(g) for g in micro_batches(decodes, 4)] == [2, 1, 2, 1]
    mixed = _spans(1, 1, 30, 16)  # decodes first, then prefill chunks
    groups = micro_batches(mixed, 2)
    assert [[len(s.token_ids) for s in g] for g in groups] == [[1, 1, 30], [16]]
    assert [s for g in groups for s in g] == mixed
    assert micro_batches(_spans(40), 4) == [_spans(40)]  # one span: one micro-batch
    assert micro_batches(_spans(3, 3), 1) == [_spans(3, 3)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be at least 1"),
        (
            {"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram"}},
            "speculative decoding runs on one rank",
        ),
        (
            {"pipeline_parallel_size": 2, "kv_pool_factory": lambda layout, n: None},
            "holds one rank's pool",
        ),
    ],
)
def test_what_pipeline_stages_do_not_combine_with_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_the_world_is_tp_times_pp():
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6
