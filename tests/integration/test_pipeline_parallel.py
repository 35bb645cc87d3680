"""Pipeline parallelism: two stages (and two stages of two tensor-parallel ranks) give the
tokens and logprobs one rank gives, over gloo on the CPU (with TOKENYARD_TEST_DEVICE=cuda,
NCCL over as many GPUs: scripts/gpu_check.sh).

The checkpoint is a tiny random Llama built by transformers' own classes, with three layers
so that the two stages hold different numbers of layers ([0, 2) and [2, 3)). Each engine
spawns its other ranks, which load the model and keep their stage's layers.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
from moe_checkpoints import save_hf_folder

from tokenyard import LLM, SamplingParams
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine

TOL = 1e-3  # the dense fp32 tolerance of the HF-equivalence tests
DEVICE = os.environ.get("TOKENYARD_TEST_DEVICE", "cpu")

# Prompts of token ids: several blocks, and a 70-token prompt that prefills in two chunks.
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (5, 41, 70, 17)]
PARAMS = SamplingParams(
    max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
)
ENGINE = dict(
    block_size=16,
    max_num_batched_tokens=48,  # chunked prefill: steps mix prefill chunks and decodes
    max_num_seqs=8,
    kv_cache_bytes=2 * 1024**2,
    num_threads=1,
    device=DEVICE,
)


def tiny_llama(**overrides):
    import transformers

    config = transformers.LlamaConfig(
        **(
            dict(
                vocab_size=49152,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                rope_theta=50000.0,
                tie_word_embeddings=False,
                initializer_range=0.2,  # logits that differ: at 0.02 every token ties
            )
            | overrides
        )
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return str(save_hf_folder(tiny_llama(), tmp_path_factory.mktemp("llama3")))


def generate(folder: str, **sizes):
    llm = LLM(folder, **(ENGINE | sizes))
    try:
        return llm.generate(PROMPTS, PARAMS), llm.engine.memory
    finally:
        llm.close()


def assert_same_logprobs(one, other) -> None:
    for a, b in zip(one, other, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs and b.logprobs
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(la.logprob - lb.logprob) <= TOL
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            for (_, va), (_, vb) in zip(la.top, lb.top, strict=True):
                assert abs(va - vb) <= TOL
        assert a.prompt_logprobs and b.prompt_logprobs
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert pa is not None and pb is not None and pa.token_id == pb.token_id
            assert abs(pa.logprob - pb.logprob) <= TOL


@pytest.fixture(scope="module")
def one_rank(llama_folder):
    return generate(llama_folder)


def test_two_stages_give_one_ranks_tokens_and_logprobs(llama_folder, one_rank):
    one, mem1 = one_rank
    two, mem2 = generate(llama_folder, pipeline_parallel_size=2)
    assert_same_logprobs(one, two)
    assert all(len(r.token_ids) == PARAMS.max_tokens for r in two)
    # Rank 0's report: stage 0's two layers of three, so 2/3 of the KV bytes per block.
    assert mem2.pp_size == 2 and "x2 ranks" in mem2.describe()
    assert mem2.block_nbytes * 3 == mem1.block_nbytes * 2


@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks_give_one_ranks(llama_folder, one_rank):
    one, _ = one_rank
    four, mem4 = generate(llama_folder, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert_same_logprobs(one, four)
    assert mem4.tp_size == 2 and mem4.pp_size == 2 and "x4 ranks" in mem4.describe()


def test_more_stages_than_layers_are_refused_before_any_process_starts(llama_folder):
    config = EngineConfig(model=llama_folder, pipeline_parallel_size=4, **ENGINE)
    with pytest.raises(ValueError, match="pipeline_parallel_size 4 exceeds the model's 3"):
        LLMEngine(config)
    assert not mp.active_children()
