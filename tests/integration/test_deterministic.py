"""Deterministic mode on the shipped precision (bf16 + int4): a request's greedy tokens are
the same alone on a cold cache as in batches of 4 and 32, on a warm prefix cache, with
prefills cut into small chunks, after preemption and recomputation, and when one engine
prefills and another decodes. The reference for every case is each prompt run alone, caching off."""

from __future__ import annotations

import pytest

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


def run(engine, prompts, tag):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", chat(p), PARAMS)
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


def test_preemption_recomputes_the_same_tokens(make_engine, reference):
    engine = make_engine(**SHIPPED)
    few = PROMPTS[:8]
    for i, p in enumerate(few):
        engine.add_request(f"p{i}", chat(p), PARAMS)
    seqs = [engine.seqs[f"p{i}"] for i in range(len(few))]
    for _ in range(3):  # the prompts prefilled and a few tokens decoded
        engine.step()
    # NOTE: preempted the way the scheduler does when the pool runs out; a pool sized to run
    # out would depend on prompt lengths and block sharing, this does not
    for seq in list(engine.scheduler.running)[::2]:
        engine.scheduler._preempt(seq)
    assert engine.stats().num_preemptions > 0
    while engine.has_unfinished():
        engine.step()
    assert [s.output_token_ids for s in seqs] == reference[: len(few)]
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
