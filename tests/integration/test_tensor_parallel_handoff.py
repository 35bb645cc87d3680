"""KV hand-offs between engines of different tensor-parallel sizes, on the CPU over gloo
(with TOKENYARD_TEST_DEVICE=cuda, NCCL over two GPUs: scripts/gpu_check.sh; skipped on one).

A prompt prefilled on one engine, its KV blocks read out whole-head (a tp=2 engine gathers
its ranks' shares) and written into another engine's pool (a tp=2 engine splits the heads
over its ranks), then decoded there: the tokens and logprobs one rank gives alone. One
process holds one tp=2 engine at a time (it owns the process group), so tp=2 -> tp=2 hands
off between two requests of the same engine: the blocks still go out and back in through
every rank's pool.
"""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch
from moe_checkpoints import save_hf_folder

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.outputs import TokenLogprob
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.kv.store.client import KVCacheClient
from tokenyard.kv.store.engine_bridge import fetch_prefix, offload_prefix
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings

TOL = 1e-3  # fp32, as tests/integration/test_tensor_parallel.py
PROMPTS = [[(7 * i + 3) % 4000 + 100 for i in range(n)] for n in (41, 70)]
# Two more, each seen first by the KV-cache test (70 tokens: 4 full blocks to share).
CACHE_PROMPTS = [[(11 * i + s) % 4000 + 100 for i in range(70)] for s in (5, 9)]
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
ENGINE = dict(
    block_size=16,
    max_num_batched_tokens=48,  # the 70-token prompt prefills in two chunks
    max_num_seqs=4,
    kv_cache_bytes=2 * 1024**2,
    num_threads=1,
    device=os.environ.get("TOKENYARD_TEST_DEVICE", "cpu"),
)

Run = tuple[list[int], list[TokenLogprob]]

# Three engines, one of them two processes, on a CPU other suites share.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        ENGINE["device"] != "cpu" and torch.cuda.device_count() < 2, reason="tp=2 needs 2 GPUs"
    ),
]


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
def folder(tmp_path_factory) -> str:
    return str(save_hf_folder(_llama(), tmp_path_factory.mktemp("llama-tp-handoff")))


@pytest.fixture(scope="module")
def engines(folder):
    one = LLMEngine(EngineConfig(model=folder, **ENGINE))
    two = LLMEngine(EngineConfig(model=folder, tensor_parallel_size=2, **ENGINE))
    # The reference: one rank, no prefix cache, so it computes every prompt whole.
    plain = LLMEngine(EngineConfig(model=folder, enable_prefix_caching=False, **ENGINE))
    try:
        yield {1: one, 2: two, "plain": plain}
    finally:
        two.close()


@pytest.fixture(scope="module")
def reference(engines) -> list[Run]:
    """PROMPTS then CACHE_PROMPTS, each run whole on one rank."""
    plain = engines["plain"]
    for i, prompt in enumerate(PROMPTS + CACHE_PROMPTS):
        plain.add_request(f"ref{i}", prompt, PARAMS)
    runs = _drain(plain)
    return [runs[f"ref{i}"] for i in range(len(runs))]


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

    # NOTE: imported blocks are always fresh ones (never a prefix-cache hit), so the decode
    # reads exactly what was written here.
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


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
async def test_worker_kv_ports_hand_off_over_grpc_between_tensor_parallel_sizes(
    engines, reference, monkeypatch, caplog, prefill_tp, decode_tp
):
    """The workers' own KV ports, a real gRPC transfer between them: a tp=2 side stages its
    blocks (every rank's heads) for the pull, or splits the pulled blocks over its ranks."""
    from tokenyard.services.worker.engine_loop import EngineLoop
    from tokenyard.services.worker.kv import KVPort
    from tokenyard.services.worker.settings import WorkerSettings

    monkeypatch.setenv("TOKENYARD_KV_TRANSFER_ALLOWED", '["grpc"]')
    prefill, decode = engines[prefill_tp], engines[decode_tp]
    sender = KVPort(EngineLoop(prefill), WorkerSettings(role="prefill", kv_port=0))
    receiver = KVPort(EngineLoop(decode), WorkerSettings(role="decode"))
    await sender.start()
    await receiver.start()
    # The tp=2 side's transfers go through whole-head staging blocks; the other's through its pool.
    assert (sender._staging is not None, receiver._staging is not None) == (
        prefill_tp == 2,
        decode_tp == 2,
    )
    try:
        rid, prompt = f"w{prefill_tp}{decode_tp}", PROMPTS[1]
        await sender.loop.call(prefill.add_request, rid, prompt, PARAMS, prefill_only=True)
        first_tokens, first_logprobs = (await sender.loop.call(_drain, prefill))[rid]
        exported = await sender.loop.call(prefill.export_sequence, rid)
        endpoint, src = await sender.offer(rid, list(exported.block_ids))
        assert endpoint and len(src) == len(exported.block_ids)

        dst = await receiver.loop.call(
            decode.import_sequence,
            rid,
            exported.prompt_token_ids,
            exported.output_token_ids,
            PARAMS,
        )
        with caplog.at_level(logging.INFO, logger="tokenyard.kv.transfer.client"):
            assert await receiver.pull(endpoint, rid, src, dst)
        assert f"KV pull {rid}: {len(dst)} blocks" in caplog.text and "via grpc" in caplog.text
        await receiver.loop.call(decode.commit_import, rid, True)
        tokens, logprobs = (await receiver.loop.call(_drain, decode))[rid]
        _assert_same((first_tokens + tokens, first_logprobs + logprobs), reference[1])

        for _ in range(100):  # the pull's release frees the prefill's blocks and staging
            if sender.num_held == 0 and rid not in prefill.seqs:
                break
            await asyncio.sleep(0.02)
        assert sender.num_held == 0 and rid not in prefill.seqs
        for port in (sender, receiver):
            staging = port._staging
            assert staging is None or staging.num_free == staging.pool.shape[0]
    finally:
        await receiver.stop()
        await sender.stop()


@pytest.fixture
async def cache():
    server = await serve(KVCacheSettings(port=0, shutdown_grace_s=0))
    async with KVCacheClient(server.endpoint) as client:
        yield client
    await server.stop()


async def test_the_kv_cache_service_shares_blocks_between_tensor_parallel_sizes(
    engines, reference, cache
):
    """Blocks offloaded by a tp=2 engine serve a tp=1 one, and the other way round: the
    service stores whole-head blocks under the same salted hashes, whatever the sizes."""
    for (offloader, fetcher), prompt, want in zip(
        [(2, 1), (1, 2)], CACHE_PROMPTS, reference[len(PROMPTS) :], strict=True
    ):
        src, dst = engines[offloader], engines[fetcher]
        rid = f"c{offloader}{fetcher}"
        src.add_request(rid, prompt, PARAMS, prefill_only=True)
        _drain(src)
        assert await offload_prefix(src, cache, rid) == 4
        src.release(rid)

        assert await fetch_prefix(dst, cache, prompt) == 64
        dst.add_request(rid, prompt, PARAMS)
        cached = []
        tokens, logprobs = [], []
        while dst.has_unfinished():
            for out in dst.step():
                cached.append(out.num_cached_tokens)
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
        assert cached[-1] == 64  # the fetched blocks were used, not recomputed
        _assert_same((tokens, logprobs), want)
