"""The engine on the real default model: batching invariance, seeds, stops, abort, hand-off,
bad input, and a block pool that never leaks."""

from __future__ import annotations

import pytest
import torch

from tokenyard import LLM
from tokenyard.engine.block_manager import NoFreeBlocks
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.loader import ModelLoadError

PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Translate to French: good morning",
    "What is 2 + 2?",
    "Tell me a joke about computers.",
]


def finish_all(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def generate(engine, prompts, params, prefix="g"):
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", [{"role": "user", "content": p}], params)
    outs = finish_all(engine)
    return [[t for o in outs[f"{prefix}{i}"] for t in o.new_token_ids] for i in range(len(prompts))]


def test_batched_greedy_equals_unbatched(engine):
    params = SamplingParams(max_tokens=20, temperature=0)
    batched = generate(engine, PROMPTS, params, "b")
    single = [generate(engine, [p], params, f"s{i}-")[0] for i, p in enumerate(PROMPTS)]
    assert batched == single
    engine.block_manager.check_no_leaks()


def test_seed_gives_same_text_whatever_the_batch(engine):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=42)
    alone = generate(engine, PROMPTS[:1], params, "a")[0]
    noisy = SamplingParams(max_tokens=16, temperature=1.2)
    engine.add_request("n0", PROMPTS[1], noisy)
    engine.add_request("n1", PROMPTS[2], noisy)
    crowd = generate(engine, PROMPTS[:1], params, "c")[0]
    assert crowd == alone
    engine.block_manager.check_no_leaks()


def test_stop_string_not_emitted_and_text_streams(engine):
    engine.add_request(
        "st",
        "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,",
        SamplingParams(max_tokens=30, temperature=0, stop=[" 12"]),
    )
    outs = finish_all(engine)["st"]
    text = "".join(o.new_text for o in outs)
    assert outs[-1].finish_reason == "stop" and outs[-1].finished
    assert " 12" not in text and text.startswith(" 10")
    engine.block_manager.check_no_leaks()


def test_stop_token_ids_and_max_tokens(engine):
    engine.add_request("len", "Hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = finish_all(engine)["len"]
    assert len(outs) == 3 and outs[-1].finish_reason == "length"
    first = outs[0].new_token_ids[0]
    engine.add_request(
        "sti", "Hello", SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[first])
    )
    outs = finish_all(engine)["sti"]
    assert len(outs) == 1 and outs[0].finish_reason == "stop"


def test_abort_at_any_time_frees_blocks(engine):
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"ab{i}", p, params)
    assert engine.abort("ab4")  # still waiting
    engine.step()
    engine.step()
    assert engine.abort("ab0")  # running
    assert not engine.abort("nope")
    for i in (1, 2, 3):
        engine.abort(f"ab{i}")
    assert not engine.has_unfinished()
    engine.block_manager.check_no_leaks()


def test_unicode_detokenization_across_tokens(engine):
    text = "Café 日本語 🎉👩‍👩‍👧 naïve"
    ids = engine.tokenizer.encode(text)
    engine.add_request("u", "x", SamplingParams(max_tokens=1, temperature=0))
    finish_all(engine)
    # Feed the ids as a forced output through the importer path, which detokenizes them.
    engine.import_sequence(
        "u2", engine.tokenizer.encode("Say:"), ids, SamplingParams(max_tokens=len(ids) + 1)
    )
    assert engine.seqs["u2"].text == text
    engine.abort("u2")
    engine.block_manager.check_no_leaks()


@pytest.mark.parametrize(
    ("prompt", "output"), [([1, 2, 3], [2**32 - 1]), ([10**9], [5]), ([1], [-1])]
)
def test_a_forged_handoff_with_ids_past_the_vocabulary_is_refused(engine, prompt, output):
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.import_sequence("forged", prompt, output, SamplingParams(max_tokens=4))
    assert "forged" not in engine.seqs
    engine.block_manager.check_no_leaks()


def test_prefill_only_handoff_equals_aggregated(make_engine):
    """Prefill on one engine, copy the blocks into another, decode there: same tokens."""
    prefill, decode = make_engine(), make_engine()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = [{"role": "user", "content": "Explain paged attention in one sentence." * 3}]
    prefill.add_request("h", prompt, params, prefill_only=True)
    first = finish_all(prefill)["h"]
    assert first[-1].finish_reason == "prefilled"
    exported = prefill.export_sequence("h")
    dst = decode.import_sequence("h", exported.prompt_token_ids, exported.output_token_ids, params)
    decode.kv_cache[dst] = prefill.kv_cache[exported.block_ids]
    decode.commit_import("h", kv_ok=True)
    prefill.release("h")
    prefill.block_manager.check_no_leaks()
    tail = [t for o in finish_all(decode)["h"] for t in o.new_token_ids]
    handed = exported.output_token_ids + tail
    # the failed-transfer fallback recomputes and must give the same tokens
    dst = decode.import_sequence("r", exported.prompt_token_ids, exported.output_token_ids, params)
    decode.commit_import("r", kv_ok=False)
    recomputed = exported.output_token_ids + [
        t for o in finish_all(decode)["r"] for t in o.new_token_ids
    ]
    aggregated = generate(decode, ["Explain paged attention in one sentence." * 3], params, "agg")[
        0
    ]
    assert handed == aggregated == recomputed
    assert len(handed) == 12
    decode.block_manager.check_no_leaks()


def test_a_seeded_sampled_request_resumed_elsewhere_goes_on_with_the_same_tokens(engine):
    """A worker died after ``cut`` tokens; the gateway resumes the request elsewhere from
    those tokens (recomputed, no KV: here a new sequence in a busy batch). Each draw is
    seeded by (seed, output position), so the resumed run draws what the unbroken one
    drew, at temperature > 0."""
    params = SamplingParams(
        max_tokens=8, temperature=1.0, top_p=0.95, top_k=40, seed=1234, ignore_eos=True
    )
    other = SamplingParams(max_tokens=8, temperature=1.0, seed=99, ignore_eos=True)
    prompt = engine.encode_prompt([{"role": "user", "content": "Name some colours."}])
    engine.add_request("u", prompt, params)
    engine.add_request("o", prompt, other)
    outs = finish_all(engine)
    unbroken = [t for o in outs["u"] for t in o.new_token_ids]
    assert [t for o in outs["o"] for t in o.new_token_ids] != unbroken  # the seed matters
    for cut in (1, 5):
        rid = f"resumed-{cut}"
        engine.add_request(f"busy-{cut}", "A neighbour in the batch.", other)
        engine.import_sequence(rid, prompt, unbroken[:cut], params)
        engine.commit_import(rid, kv_ok=False)
        tail = [t for o in finish_all(engine)[rid] for t in o.new_token_ids]
        assert unbroken[:cut] + tail == unbroken, cut
    engine.block_manager.check_no_leaks()


def test_import_refused_when_pool_full(make_engine, kv_block_bytes):
    e = make_engine(kv_cache_bytes=8 * kv_block_bytes())
    assert e.block_manager.num_blocks == 8
    e.import_sequence("a", list(range(100, 160)), [5], SamplingParams())
    with pytest.raises(NoFreeBlocks):
        e.import_sequence("b", list(range(100, 200)), [5], SamplingParams())
    assert "b" not in e.seqs
    e.abort("a")
    e.block_manager.check_no_leaks()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "empty"), ([], "empty"), ([1, -5], "token ids"), ("word " * 9000, "at most")],
)
def test_bad_prompts_raise_and_engine_keeps_serving(engine, prompt, message):
    engine.add_request("ok", "Hi", SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams())
    outs = finish_all(engine)
    assert outs["ok"][-1].finished
    engine.block_manager.check_no_leaks()


def test_duplicate_request_id_refused(engine):
    engine.add_request("dup", "Hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "Hi", SamplingParams(max_tokens=2))
    engine.abort("dup")


def test_unknown_model_path_and_corrupt_gguf(tmp_path):
    with pytest.raises(ModelLoadError):
        LLM(model=str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        LLM(model=str(bad))


def test_memory_report_names_three_tenants(engine):
    m = engine.memory
    assert m.weights_bytes > 100e6  # 135M parameters in fp32, embeddings counted once
    assert m.weights_bytes < 700e6
    # an fp32 engine on a CPU keeps its pool in fp16 (EngineConfig.kv_cache_dtype)
    assert engine.kv_cache.dtype == engine.layout.torch_dtype == torch.float16
    assert m.kv_cache_bytes == engine.kv_cache.numel() * 2
    assert m.buffers_bytes > 0
    assert "weights" in m.describe() and "KV cache" in m.describe()


def test_offline_llm_api(loaded_model):
    from tokenyard.engine.llm import LLM as OfflineLLM

    llm = OfflineLLM.__new__(OfflineLLM)
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    llm.engine = LLMEngine(EngineConfig(kv_cache_bytes=32 * 1024**2), loaded=loaded_model)
    llm.tokenizer, llm._next_id = llm.engine.tokenizer, 0
    outs = llm.generate(
        ["The sky is", [1, 2, 3], [{"role": "user", "content": "Hi"}]],
        SamplingParams(max_tokens=5, temperature=0, logprobs=1),
    )
    assert [o.request_id for o in outs] == ["offline-0", "offline-1", "offline-2"]
    for o in outs:
        assert o.num_output_tokens <= 5 and o.finish_reason in ("stop", "length")
        assert len(o.logprobs) == o.num_output_tokens
    with pytest.raises(ValueError):
        llm.generate([], SamplingParams())


def test_engine_in_bf16_int8_still_answers(make_engine):
    engine = make_engine(dtype="bfloat16", quantization="int8")
    engine.add_request(
        "q",
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=12, temperature=0),
    )
    text = ""
    while engine.has_unfinished():
        text += "".join(o.new_text for o in engine.step())
    assert "Paris" in text
    engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])  # what dtype="auto" picks
def test_greedy_answer_survives_a_prefix_cache_hit_on_the_shipped_precision(make_engine, dtype):
    """bf16 + int4: a warm prefix cache runs the prompt's tail through the int4 kernel where a
    cold one ran it dense. With bf16 logits the top two tokens tied and the answer flipped
    ("Il Coriobella, Italy." cold, "The capital of Italy is Rome." warm); fp32 logits keep it."""
    engine = make_engine(dtype=dtype, quantization="int4")
    params = SamplingParams(max_tokens=12, temperature=0)
    question = ["What is the capital of Italy?"]
    cold = generate(engine, question, params, prefix="cold")[0]
    warm = generate(engine, question, params, prefix="warm")[0]
    assert engine.block_manager.stats.hits > 0
    assert warm == cold
    engine.block_manager.check_no_leaks()


def test_a_reserved_prefix_lands_in_the_prefix_cache(engine):
    from tokenyard.kv.hashing import prefix_block_hashes

    bs = engine.block_size
    prompt = [(i * 37) % 5000 + 20011 for i in range(2 * bs + 3)]  # tokens no other test uses
    hashes = prefix_block_hashes(prompt, bs)[:2]
    free_before = engine.stats().num_free_blocks
    with pytest.raises(ValueError, match="whole blocks"):
        engine.reserve_prefix("odd", prompt[: bs + 1])
    # A dropped reservation names nothing and frees everything.
    engine.reserve_prefix("drop", prompt[: 2 * bs])
    engine.commit_prefix("drop", kv_ok=False)
    assert engine.cached_block_ids(hashes) == []
    assert engine.stats().num_free_blocks == free_before

    blocks = engine.reserve_prefix("pre", prompt[: 2 * bs])
    assert len(blocks) == 2 and not engine.has_unfinished()  # never scheduled
    assert engine.stats().num_free_blocks == free_before - 2
    engine.commit_prefix("pre", kv_ok=True)
    assert engine.cached_block_ids(hashes) == list(zip(hashes, blocks, strict=True))
    assert engine.stats().num_free_blocks == free_before  # free, but findable
    engine.add_request("use", prompt, SamplingParams(max_tokens=1))
    (out,) = finish_all(engine)["use"]
    assert out.num_cached_tokens == 2 * bs


def test_an_fp8_kv_pool_serves_prefix_hits_as_it_served_the_miss(make_engine, kv_block_bytes):
    """kv_cache_dtype="fp8": e4m3 blocks of a quarter of an fp32 block's bytes, and a prompt
    served from the prefix cache decodes what it decoded when computed. Its logprobs differ
    by a few hundredths: computing only the prompt's tail moves the keys by about 1e-6 (a
    GEMM of fewer rows), and where that crosses an e4m3 rounding boundary the stored key
    moves by a whole e4m3 step (2^-4 of it). An fp16 pool gives 4e-4 the same way, an fp32
    one 6e-6. (That the fresh prefill attends over rounded keys, as the hit does, is
    test_cpu_kernels' fp32-beside-fp8 case.)"""
    engine = make_engine(kv_cache_dtype="fp8")
    assert engine.kv_cache.dtype == engine.layout.torch_dtype == torch.float8_e4m3fn
    assert kv_block_bytes(kv_cache_dtype="fp8") * 4 == kv_block_bytes(kv_cache_dtype="float32")
    prompt = " ".join(PROMPTS) * 2  # several blocks
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)

    def run(rid):
        engine.add_request(rid, prompt, params)
        outs = finish_all(engine)[rid]
        return outs[-1].num_cached_tokens, [o for o in outs if o.new_token_ids]

    cold_cached, cold = run("cold")
    warm_cached, warm = run("warm")
    assert cold_cached == 0 and warm_cached >= 3 * engine.block_size
    assert [o.new_token_ids for o in warm] == [o.new_token_ids for o in cold]
    for a, b in zip(cold, warm, strict=True):
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert [t for t, _ in la.top] == [t for t, _ in lb.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(la.top, lb.top, strict=True)) < 0.1
    engine.block_manager.check_no_leaks()
