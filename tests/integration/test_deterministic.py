"""Deterministic mode on the shipped precision (bf16 + int4): a request's greedy tokens are
the same alone on a cold cache as in batches of 4 and 32, on a warm prefix cache, with
prefills cut into small chunks, after preemption and recomputation, and when one engine
prefills and another decodes. The reference for every case is each prompt run alone, caching off."""

from __future__ import annotations

import pytest
import torch
from moe_checkpoints import VOCAB, hf_moe_model, save_hf_folder

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.memory import kv_layout
from tokenyard.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TOPICS = [
    "the sea", "a lighthouse", "bread", "trains", "winter", "a library", "bees", "the moon",
    "coffee", "a violin", "rivers", "chess", "volcanoes", "a garden", "clocks", "snow",
]  # fmt: skip
PROMPTS = [f"Write one sentence about {t}." for t in TOPICS] + [
    f"Name two facts about {t}." for t in TOPICS
]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SHIPPED = {"dtype": "bfloat16", "quantization": "int4", "deterministic": True}


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def run(engine, prompts, tag, params=PARAMS):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", chat(p) if isinstance(p, str) else p, params)
    seqs = [engine.seqs[f"{tag}{i}"] for i in range(len(prompts))]
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs]


@pytest.fixture(scope="module")
def cold(make_engine):
    """An engine that caches nothing: every run starts cold."""
    return make_engine(**SHIPPED, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(cold):
    """Each prompt alone (batch size 1), nothing cached."""
    return [run(cold, [p], f"ref{i}-")[0] for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("size", [4, 32])
def test_batch_sizes(cold, reference, size):
    got = [t for i in range(0, 32, size) for t in run(cold, PROMPTS[i : i + size], f"b{size}-{i}-")]
    assert got == reference


def test_warm_prefix_cache(make_engine, reference):
    engine = make_engine(**SHIPPED)
    assert run(engine, PROMPTS, "first") == reference
    hits = engine.block_manager.stats.hits
    assert run(engine, PROMPTS, "warm") == reference  # the same prompts again: all cached
    assert engine.block_manager.stats.hits > hits
    engine.block_manager.check_no_leaks()


def test_chunked_prefill(make_engine, reference):
    chunked = make_engine(**SHIPPED, max_num_batched_tokens=7)  # prompts cut into 7-token chunks
    assert run(chunked, PROMPTS, "c") == reference
    chunked.block_manager.check_no_leaks()


def test_preemption_recomputes_the_same_tokens(make_engine, loaded_model, cold):
    """A KV pool that holds the prompts but not their growth: decoding must preempt."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    few = PROMPTS[:8]
    reference = [run(cold, [p], f"pre{i}-", params)[0] for i, p in enumerate(few)]
    bs = EngineConfig().block_size
    lengths = [len(cold.encode_prompt(chat(p))) for p in few]
    admitted = sum(-(-n // bs) for n in lengths)  # blocks the prompts take
    grown = sum(-(-(n + params.max_tokens - 1) // bs) for n in lengths)  # and at the end
    assert grown > admitted, "the outputs must outgrow the prompts' blocks for this test"
    block_nbytes = kv_layout(loaded_model, EngineConfig(**SHIPPED)).block_nbytes
    # No prefix caching: shared template blocks would leave the pool room to spare.
    engine = make_engine(
        **SHIPPED, enable_prefix_caching=False, kv_cache_bytes=admitted * block_nbytes
    )
    assert engine.block_manager.num_blocks == admitted
    assert run(engine, few, "p", params) == reference
    assert engine.stats().num_preemptions > 0
    engine.block_manager.check_no_leaks()


def test_disaggregated_prefill_then_decode(make_engine, reference):
    prefill, decode = make_engine(**SHIPPED), make_engine(**SHIPPED)
    few = PROMPTS[:6]
    for i, p in enumerate(few):
        prefill.add_request(f"d{i}", chat(p), PARAMS, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    for i in range(len(few)):
        exported = prefill.export_sequence(f"d{i}")
        dst = decode.import_sequence(
            f"d{i}", exported.prompt_token_ids, exported.output_token_ids, PARAMS
        )
        decode.kv_cache[dst] = prefill.kv_cache[exported.block_ids]
        decode.commit_import(f"d{i}", kv_ok=True)
        prefill.release(f"d{i}")
    seqs = [decode.seqs[f"d{i}"] for i in range(len(few))]
    while decode.has_unfinished():
        decode.step()
    assert [s.output_token_ids for s in seqs] == reference[: len(few)]
    decode.block_manager.check_no_leaks()


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def close_router_moe(request, tmp_path_factory):
    """A tiny MoE whose router scores are close (the init scale, not the decisive one the
    HF-equivalence tests use): where a score's last bits depend on the row count, top-k
    picks other experts."""
    model = hf_moe_model(request.param, hidden_size=128)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight") and p.shape[0] == 4:
                p.normal_(0.0, 0.02)
    return save_hf_folder(model, tmp_path_factory.mktemp(request.param) / "tiny")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_router_is_batch_invariant(close_router_moe, dtype):
    """Each prompt alone against all of them in one batch and in 5-token chunks: the same
    experts and so the same tokens, in fp32 too, where a batched router matmul's bits differ
    from a one-row one."""

    def engine(**kwargs) -> LLMEngine:
        config = EngineConfig(
            model=str(close_router_moe),
            dtype=dtype,
            quantization="int4",
            deterministic=True,
            enable_prefix_caching=False,
            kv_cache_bytes=16 * 1024**2,
            **kwargs,
        )
        return LLMEngine(config)

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (7 + 5 * i,), generator=g).tolist() for i in range(12)]
    alone = engine()
    reference = [run(alone, [p], f"a{i}-")[0] for i, p in enumerate(prompts)]
    assert len({tuple(r) for r in reference}) > 1  # prompts that lead somewhere different
    assert run(engine(), prompts, "batch") == reference
    assert run(engine(max_num_batched_tokens=5), prompts, "chunk") == reference
