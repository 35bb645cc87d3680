"""Tensor parallelism's checks and bookkeeping, without starting ranks (the 2-rank runs are
in tests/integration/test_tensor_parallel.py)."""

from __future__ import annotations

import pytest

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.memory import MemoryReport
from tokenyard.engine.parallel import rank_device
from tokenyard.kv.layout import KVLayout, layout_from_proto, layout_to_proto
from tokenyard.models.config import ModelConfig
from tokenyard.models.tp import check_tp
from tokenyard.v1 import kv_pb2

SMOLLM2 = ModelConfig(  # the default model's shape: 9 query heads, 3 KV heads
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def test_the_default_model_splits_over_no_tp_above_one():
    check_tp(SMOLLM2, 1)
    with pytest.raises(ValueError, match=r"must divide the model's num_attention_heads \(9\)"):
        check_tp(SMOLLM2, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
        check_tp(SMOLLM2, 9)  # 9 query heads split, but not 3 KV heads: not replicated


def test_gqa_shapes_that_split():
    from dataclasses import replace

    gqa = replace(SMOLLM2, num_attention_heads=32, num_key_value_heads=8, intermediate_size=1024)
    for tp in (1, 2, 4, 8):
        check_tp(gqa, tp)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp(gqa, 16)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tp(replace(gqa, intermediate_size=1004), 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speculative_config": {"method": "ngram"}}, "speculative decoding runs on one rank"),
        ({"kv_pool_factory": lambda layout, n: None}, "holds one rank's pool"),
    ],
)
def test_what_tp_does_not_combine_with_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tensor_parallel_size=2, **kwargs)


def test_quantization_is_allowed_with_tp():
    assert EngineConfig(tensor_parallel_size=2, quantization="int4").tensor_parallel_size == 2


def test_each_rank_takes_the_next_gpu():
    assert rank_device("cpu", 1) == "cpu"
    assert rank_device("cuda", 1) == "cuda:1"
    assert rank_device("cuda:2", 3) == "cuda:5"


def test_layout_carries_tp_size_on_the_wire():
    layout = KVLayout("m", "bfloat16", 16, 30, num_kv_heads=4, head_dim=64, tp_size=2)
    assert layout_from_proto(layout_to_proto(layout)) == layout
    old_peer = layout_to_proto(KVLayout("m", "bfloat16", 16, 30, 8, 64))
    old_peer.ClearField("tp_size")  # a peer from before tp_size: 0 on the wire
    assert isinstance(old_peer, kv_pb2.KVLayoutDesc)
    assert layout_from_proto(old_peer).tp_size == 1
    why = layout.mismatch(layout_from_proto(old_peer))
    assert why is not None and "tp_size: 2 != 1" in why
    assert "num_kv_heads: 4 != 8" in why
    # A rank's share never crosses as is: its engine sends the whole-head blocks.
    assert layout.whole_heads().mismatch(layout_from_proto(old_peer)) is None


def test_memory_report_says_its_figures_are_per_rank():
    report = MemoryReport(
        weights_bytes=2**20,
        kv_cache_bytes=2**20,
        buffers_bytes=0,
        num_blocks=4,
        block_nbytes=2**18,
        tp_size=4,
    )
    assert report.describe().endswith("per rank, x4 ranks")
    assert "ranks" not in MemoryReport(1, 1, 0, 1, 1).describe()
