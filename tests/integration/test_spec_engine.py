"""Speculative decoding on the real default model: greedy output equal to plain decoding
through batching, chunked prefill, prefix-cache hits, preemption and the KV hand-off; sampled
output reproducible by seed; acceptance counted."""

from __future__ import annotations

import pytest

from tokenyard import LLM, platforms
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.loader import default_model_path

pytestmark = pytest.mark.slow

COPY = (
    "Copy this list exactly, then stop: apples, pears, plums, figs, dates, limes, "
    "apples, pears, plums, figs, dates, limes."
)
PROMPTS = [COPY, "Write a haiku about the sea.", "What is 2 + 2?"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def finish_all(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def generate(engine, prompts, params, prefix):
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", [{"role": "user", "content": p}], params)
    outs = finish_all(engine)
    return [[t for o in outs[f"{prefix}{i}"] for t in o.new_token_ids] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain(make_engine):
    """Greedy tokens of PROMPTS without speculation, batched (the reference)."""
    return generate(make_engine(), PROMPTS, GREEDY, "p")


@pytest.mark.parametrize(
    "spec",
    [NGRAM, {"method": "draft", "model": None, "num_speculative_tokens": 3}],
    ids=["ngram", "self-draft"],
)
def test_greedy_equals_plain_decoding_batched_chunked_and_cached(make_engine, plain, spec):
    # A 32-token budget chunks every prompt; the second round hits the prefix cache.
    engine = make_engine(speculative_config=spec, max_num_batched_tokens=32)
    assert generate(engine, PROMPTS, GREEDY, "a") == plain
    assert generate(engine, PROMPTS, GREEDY, "b") == plain
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0
    assert stats.spec_mean_accepted_length > 1.0
    engine.block_manager.check_no_leaks()
    memory = engine.memory  # a self-draft adds its int4 copies, and no KV pool of its own
    assert memory.draft_kv_cache_bytes == 0
    if spec["method"] == "ngram":
        assert memory.draft_weights_bytes == 0
    else:
        assert 0 < memory.draft_weights_bytes < memory.weights_bytes / 4
        assert "draft weights" in memory.describe()


def test_draft_model_from_a_path_with_its_own_pool_and_a_handoff(make_engine, plain):
    """A separate draft (its own KV pool) catches up on an imported prompt, then drafts."""
    spec = {"method": "draft", "model": default_model_path(), "quantization": "int4"}
    prefill = make_engine()
    prefill.add_request("h", [{"role": "user", "content": COPY}], GREEDY, prefill_only=True)
    finish_all(prefill)
    exported = prefill.export_sequence("h")
    kv = prefill.kv_cache[exported.block_ids].clone()  # the blocks a transfer would carry
    prefill.release("h")
    prefill.block_manager.check_no_leaks()
    del prefill  # at most two models (target and draft) alive at once
    decode = make_engine(speculative_config=spec)
    dst = decode.import_sequence("h", exported.prompt_token_ids, exported.output_token_ids, GREEDY)
    decode.kv_cache[dst] = kv
    decode.commit_import("h", kv_ok=True)
    handed = exported.output_token_ids + [
        t for o in finish_all(decode)["h"] for t in o.new_token_ids
    ]
    assert handed == plain[0]
    assert decode.stats().spec_acceptance_rate > 0.5
    # Its own pool: as many blocks as the target's, of the same model (so the same bytes).
    assert decode.memory.draft_kv_cache_bytes == decode.memory.kv_cache_bytes
    assert decode.memory.draft_weights_bytes > 0
    decode.block_manager.check_no_leaks()


def test_preemption_under_a_small_pool_keeps_greedy_output(make_engine, plain, kv_block_bytes):
    # 6 blocks: the three chats share their system prompt's blocks, and still cannot all fit
    engine = make_engine(speculative_config=NGRAM, kv_cache_bytes=6 * kv_block_bytes())
    assert engine.block_manager.num_blocks == 6
    assert generate(engine, PROMPTS, GREEDY, "s") == plain
    assert engine.stats().num_preemptions > 0
    engine.block_manager.check_no_leaks()


def test_sampled_speculation_is_reproducible_and_stops_where_asked(loaded_model):
    llm = LLM(speculative_config=NGRAM, kv_cache_bytes=64 * 1024**2)
    chat = [{"role": "user", "content": COPY}]
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    first = llm.chat(chat, params)[0]
    again = llm.chat(chat, params)[0]
    assert first.token_ids == again.token_ids and len(first.token_ids) == 20
    # Greedy, it copies the list; drafts run past the stop string, which still ends the text.
    stopped = llm.chat(chat, SamplingParams(max_tokens=40, temperature=0, stop=["dates, limes"]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text.endswith("figs, ") and stopped.text.count("figs") == 1
    assert llm.engine.stats().spec_accepted_tokens > 0
    llm.engine.block_manager.check_no_leaks()


def test_self_draft_refuses_a_quantized_target(make_engine):
    with pytest.raises(ValueError, match="needs an unquantized target"):
        make_engine(quantization="int4", speculative_config={"method": "draft"})


@pytest.mark.parametrize(("role", "speculates"), [("decode", True), ("prefill", False)])
def test_worker_engine_speculates_where_it_decodes(role, speculates):
    from tokenyard.services.worker.main import build_engine
    from tokenyard.services.worker.settings import WorkerSettings

    settings = WorkerSettings(
        role=role,
        speculative='{"method": "ngram"}',
        kv_cache_bytes=16 * 1024**2,
        kv_shared_memory=False,
    )
    engine, _params = build_engine(settings)
    assert (engine.speculator is not None) == speculates


DETERMINISTIC = {"dtype": "bfloat16", "quantization": "int4", "deterministic": True}


def test_greedy_equals_plain_decoding_exactly_in_deterministic_mode(make_engine):
    """The shipped precision (bf16 + int4) in deterministic mode: a verification row gets the
    kernels a decode row gets (the int4 kernel at every row count, one query per token in
    attention), so greedy output is plain decoding's, bit for bit, batched, chunked and
    cached. Sampled requests do not speculate in this mode."""
    plain = generate(make_engine(**DETERMINISTIC), PROMPTS, GREEDY, "p")
    engine = make_engine(**DETERMINISTIC, speculative_config=NGRAM, max_num_batched_tokens=32)
    assert generate(engine, PROMPTS, GREEDY, "a") == plain
    assert generate(engine, PROMPTS, GREEDY, "b") == plain
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.spec_accepted_tokens > 0
    drafts = stats.spec_draft_tokens
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)
    generate(engine, PROMPTS[:1], sampled, "s")
    assert engine.stats().spec_draft_tokens == drafts
    engine.block_manager.check_no_leaks()


# How far a verification row's logprob may sit from a decode row's in bf16 (bf16 steps near
# a logit of 20 are 0.125); two rows can choose differently only where the top two tokens
# are closer than twice this. With native bf16 (AVX512-BF16, AMX) oneDNN's kernels round
# differently from the emulated path, and a self-draft verification row measured 0.30 from
# the decode row on an AVX512-BF16 EPYC (the same token chosen, top two 0.25 apart): 0.35
# there. The test also measures how far the same rows move between batches of different
# sizes on this machine and allows that instead when larger.
BF16_ROW_TOL = 0.35 if platforms.cpu().native_bf16 else 0.25


def _logprob_gap(ref: list[list], got: list[list]) -> float:
    """The largest logprob difference over each pair of runs' common greedy prefix."""
    gap = 0.0
    for a_run, b_run in zip(ref, got, strict=True):
        for a, b in zip(a_run, b_run, strict=True):
            if a.token_id != b.token_id:
                break
            gap = max(gap, abs(a.logprob - b.logprob))
    return gap


@pytest.mark.parametrize(
    "spec",
    [NGRAM, {"method": "draft", "model": None, "num_speculative_tokens": 3}],
    ids=["ngram", "self-draft"],
)
def test_bf16_greedy_equals_plain_decoding_but_at_near_ties(make_engine, spec):
    """bf16 without deterministic mode: a verification row runs in a bigger matmul and
    through the chunked-prefill attention, a decode row through the decode kernel, so their
    logits may differ in the last bits (as rows of different batches may). Speculated greedy
    output equals plain decoding wherever plain decoding's top two tokens are further apart
    than that difference; it may part only at such a near-tie."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    def run(engine, tag, prompts=PROMPTS):
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", [{"role": "user", "content": p}], params)
        outs = finish_all(engine)
        return [
            [lp for o in outs[f"{tag}{i}"] for lp in o.logprobs or []] for i in range(len(prompts))
        ]

    plain_engine = make_engine(dtype="bfloat16")
    plain = run(plain_engine, "p")
    alone = [run(plain_engine, f"a{i}", [p])[0] for i, p in enumerate(PROMPTS)]
    tol = max(BF16_ROW_TOL, _logprob_gap(plain, alone))  # the batch's own effect here
    speculated = run(make_engine(dtype="bfloat16", speculative_config=spec), "s")
    equal = 0
    for ref, got in zip(plain, speculated, strict=True):
        for a, b in zip(ref, got, strict=True):
            if b.token_id != a.token_id:  # parted: only where plain's top two nearly tie
                (_, first), (_, second) = a.top[:2]
                assert first - second <= 2 * tol, (first, second, tol)
                break
            assert abs(a.logprob - b.logprob) <= tol, (a, b, tol)
            equal += 1
    assert equal >= 8
