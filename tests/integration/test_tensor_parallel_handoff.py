"""KV hand-offs between engines of different tensor-parallel sizes, on the CPU over gloo.

A prompt prefilled on one engine, its KV blocks read out whole-head (a tp=2 engine gathers
its ranks' shares) and written into another engine's pool (a tp=2 engine splits the heads
over its ranks), then decoded there: the tokens and logprobs one rank gives alone. One
process holds one tp=2 engine at a time (it owns the process group), so tp=2 -> tp=2 hands
off between two requests of the same engine: the blocks still go out and back in through
every rank's pool.
"""

from __future__ import annotations

import pytest
import torch
from moe_checkpoints import save_hf_folder

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.outputs import TokenLogprob
from tokenyard.engine.sampling_params import SamplingParams

TOL = 1e-3  # fp32, as tests/integration/test_tensor_parallel.py
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (41, 70)]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
ENGINE = dict(
    block_size=16,
    max_num_batched_tokens=48,  # the 70-token prompt prefills in two chunks
    max_num_seqs=4,
    kv_cache_bytes=2 * 1024**2,
    num_threads=1,
    enable_prefix_caching=False,  # the decode side must read what was written, not a hit
)

Run = tuple[list[int], list[TokenLogprob]]


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # one KV head per rank at tp=2
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,  # logits that differ: at 0.02 every token ties
    )
    torch.manual_seed(2)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    folder = str(save_hf_folder(_llama(), tmp_path_factory.mktemp("llama-tp-handoff")))
    one = LLMEngine(EngineConfig(model=folder, **ENGINE))
    two = LLMEngine(EngineConfig(model=folder, tensor_parallel_size=2, **ENGINE))
    try:
        yield {1: one, 2: two}
    finally:
        two.close()


@pytest.fixture(scope="module")
def reference(engines) -> list[Run]:
    """Each prompt run whole on one rank."""
    one = engines[1]
    for i, prompt in enumerate(PROMPTS):
        one.add_request(f"ref{i}", prompt, PARAMS)
    return [runs for _, runs in sorted(_drain(one).items())]


def _drain(engine: LLMEngine) -> dict[str, Run]:
    runs: dict[str, Run] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs = runs.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            logprobs += out.logprobs or []
    return runs


def _hand_off(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int]) -> Run:
    """Prefill on one engine, move the KV as a worker's hand-off does, decode on the other."""
    prefill.add_request(rid, prompt, PARAMS, prefill_only=True)
    first_tokens, first_logprobs = _drain(prefill)[rid]
    exported = prefill.export_sequence(rid)
    blocks = prefill.read_kv_blocks(exported.block_ids)
    prefill.release(rid)
    assert prefill.layout is not None and decode.layout == prefill.layout  # whole-head
    assert tuple(blocks.shape) == prefill.layout.pool_shape(len(exported.block_ids))

    into = f"{rid}-decode"
    dst = decode.import_sequence(into, exported.prompt_token_ids, exported.output_token_ids, PARAMS)
    decode.write_kv_blocks(dst, blocks)
    assert torch.equal(decode.read_kv_blocks(dst), blocks)  # each rank got its heads back
    decode.commit_import(into, kv_ok=True)
    tokens, logprobs = _drain(decode)[into]
    return first_tokens + tokens, first_logprobs + logprobs


def _assert_same(got: Run, want: Run) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) == PARAMS.max_tokens
    for a, b in zip(got[1], want[1], strict=True):
        assert a.token_id == b.token_id
        assert abs(a.logprob - b.logprob) <= TOL
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        for (_, x), (_, y) in zip(a.top, b.top, strict=True):
            assert abs(x - y) <= TOL


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_a_hand_off_between_tensor_parallel_sizes_decodes_as_one_rank(
    engines, reference, prefill_tp, decode_tp
):
    for i, prompt in enumerate(PROMPTS):
        got = _hand_off(
            engines[prefill_tp], engines[decode_tp], f"h{prefill_tp}{decode_tp}{i}", prompt
        )
        _assert_same(got, reference[i])


def test_heads_written_to_the_wrong_ranks_change_the_tokens(engines, reference):
    """The control: the same path with the two KV heads swapped must go wrong, so the
    equality above depends on each rank getting its own heads."""
    one, two = engines[1], engines[2]
    one.add_request("c", PROMPTS[1], PARAMS, prefill_only=True)
    _drain(one)
    exported = one.export_sequence("c")
    blocks = one.read_kv_blocks(exported.block_ids).flip(4).contiguous()  # heads swapped
    one.release("c")
    dst = two.import_sequence("c", exported.prompt_token_ids, exported.output_token_ids, PARAMS)
    two.write_kv_blocks(dst, blocks)
    two.commit_import("c", kv_ok=True)
    tokens, logprobs = _drain(two)["c"]
    want = reference[1][1][1:]
    assert any(abs(a.logprob - b.logprob) > TOL for a, b in zip(logprobs, want, strict=True))


def test_blocks_in_another_layout_are_refused(engines):
    two = engines[2]
    assert two.layout is not None and two.layout.num_kv_heads == 2  # both ranks' heads
    rank_share = torch.zeros((1, 2, 2, 16, 1, 16))  # one rank's heads only
    with pytest.raises(ValueError, match="are not"):
        two.write_kv_blocks([0], rank_share)
