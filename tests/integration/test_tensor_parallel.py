"""Tensor parallelism: two ranks give the logprobs one rank gives (gloo on the CPU; with
TOKENYARD_TEST_DEVICE=cuda, NCCL over two GPUs: scripts/gpu_check.sh).

The checkpoints are tiny random models built by transformers' own classes: the default
model's 9 query and 3 KV heads split over no tp > 1. Each engine at tp=2 spawns one other
process, which loads the model, keeps its half and runs every step's forward with rank 0.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
from moe_checkpoints import hf_moe_model, save_hf_folder
from same_logprobs import assert_same_logprobs

from tokenyard import LLM, SamplingParams
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine

DEVICE = os.environ.get("TOKENYARD_TEST_DEVICE", "cpu")
cpu_only = pytest.mark.skipif(
    DEVICE != "cpu", reason="weight quantization and this check run on the CPU"
)

# Prompts of token ids, long enough for several blocks and chunks at the settings below.
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (5, 41, 70, 17)]
PARAMS = SamplingParams(
    max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2
)
ENGINE = dict(
    block_size=16,
    max_num_batched_tokens=48,  # the 70-token prompt prefills in two chunks
    max_num_seqs=8,
    kv_cache_bytes=4 * 1024**2,
    num_threads=1,
    device=DEVICE,
)


def _llama(**overrides):
    import transformers

    config = transformers.LlamaConfig(
        **(
            dict(
                vocab_size=49153,  # odd: the last rank's vocabulary rows are padded
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
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


def _qwen2():
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    torch.manual_seed(1)
    return transformers.Qwen2ForCausalLM(config).eval()


CHECKPOINTS = {
    "llama-gqa-untied": _llama,
    "qwen2-bias-tied": _qwen2,  # q/k/v biases sharded with their heads; tied vocab shards
    "mixtral": lambda: hf_moe_model("mixtral"),
}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def folder(request, tmp_path_factory):
    model = CHECKPOINTS[request.param]()
    return str(save_hf_folder(model, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return str(save_hf_folder(_llama(), tmp_path_factory.mktemp("llama")))


def _generate(folder: str, tp: int, **extra):
    llm = LLM(folder, tensor_parallel_size=tp, **(ENGINE | extra))
    try:
        return llm.generate(PROMPTS, PARAMS), llm.engine.memory
    finally:
        llm.close()


@pytest.mark.slow
def test_two_ranks_give_one_ranks_logprobs(folder):
    one, mem1 = _generate(folder, 1)
    two, mem2 = _generate(folder, 2)
    assert_same_logprobs(one, two)
    assert all(len(r.token_ids) == PARAMS.max_tokens for r in two)
    # The report is one rank's: half the KV heads per block, its share of the weights.
    assert mem2.tp_size == 2 and "x2 ranks" in mem2.describe()
    assert mem2.block_nbytes * 2 == mem1.block_nbytes
    assert mem2.weights_bytes < 0.6 * mem1.weights_bytes


@pytest.fixture(scope="module")
def dense_one_rank(llama_folder):
    return _generate(llama_folder, 1)[0]


@pytest.mark.slow
@cpu_only
@pytest.mark.parametrize("precision", [{"quantization": "int8"}, {"dtype": "bfloat16"}])
def test_two_ranks_at_lower_precision_stay_as_close_as_one(llama_folder, dense_one_rank, precision):
    """int8 is quantized per rank's slice (a row-parallel layer gets its slice's scales),
    and bf16 sums partial outputs in bf16: two ranks are near one rank at that precision,
    not equal to it. Decode rows run int8's quantized kernel (prefill chunks its dense copy)."""
    one, _ = _generate(llama_folder, 1, **precision)
    two, _ = _generate(llama_folder, 2, **precision)

    def gap(results) -> float:
        return max(
            abs(x.logprob - y.logprob)
            for r, d in zip(results, dense_one_rank, strict=True)
            for x, y in zip(r.logprobs, d.logprobs, strict=True)
        )

    assert gap(one) > 0 and gap(two) <= max(2 * gap(one), 0.05), (gap(one), gap(two))


def test_heads_that_do_not_split_are_refused_before_any_process_starts(llama_folder):
    config = EngineConfig(model=llama_folder, tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        LLMEngine(config)
    assert not mp.active_children()


@pytest.mark.slow
@cpu_only
def test_a_worker_with_two_ranks_offers_whole_head_blocks(llama_folder, monkeypatch):
    """TOKENYARD_WORKER_TENSOR_PARALLEL_SIZE reaches the engine; rank 0's pool holds half
    the KV heads, so the engine offers no pool of its own, and its blocks cross its
    boundary with every head (test_tensor_parallel_handoff.py hands them off)."""
    from tokenyard.services.worker.main import build_engine
    from tokenyard.services.worker.settings import WorkerSettings

    monkeypatch.setenv("TOKENYARD_WORKER_TENSOR_PARALLEL_SIZE", "2")
    settings = WorkerSettings(
        model=llama_folder, role="prefill", kv_cache_bytes=4 * 1024**2, num_threads=1
    )
    engine, params_cls = build_engine(settings)
    assert isinstance(engine, LLMEngine)
    try:
        assert engine.config.tensor_parallel_size == 2
        assert engine.kv_cache is None and engine.layout is not None
        assert (engine.layout.num_kv_heads, engine.layout.tp_size) == (2, 1)  # both ranks'
        assert engine.config.kv_pool_factory is None  # no shared-memory pool for TP
        engine.add_request("r", PROMPTS[1], params_cls(max_tokens=3, temperature=0.0))
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        assert [o.finish_reason for o in outs if o.finished] == ["length"]
    finally:
        engine.close()


@pytest.mark.slow
@cpu_only
def test_a_failed_start_leaves_no_ranks_and_no_process_group(llama_folder):
    import torch.distributed as dist

    config = EngineConfig(
        model=llama_folder, tensor_parallel_size=2, **(ENGINE | {"kv_cache_bytes": 1})
    )
    with pytest.raises(ValueError, match="fewer than 2 KV blocks"):
        LLMEngine(config)
    assert not mp.active_children()
    assert not dist.is_initialized()  # so the next engine can start its own group
