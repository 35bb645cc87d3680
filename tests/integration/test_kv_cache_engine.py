"""A prompt prefilled on one engine, offloaded to the KV-cache service, then served on
another engine from the cache: same tokens as computing it all, and the fetched KV is
really what the second engine used."""

from __future__ import annotations

import pytest
import torch

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.kv.hashing import prefix_block_hashes, salted_root
from tokenyard.kv.store.client import KVCacheClient
from tokenyard.kv.store.engine_bridge import (
    fetch_prefix,
    offload_prefix,
    offload_snapshot,
    snapshot_stored_blocks,
)
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings

# Four engines on a CPU that other suites share: well over 20 s there.
pytestmark = pytest.mark.slow

PROMPT = [(i * 7919) % 30000 + 100 for i in range(16 * 5 + 3)]  # 5 full blocks + 3
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def engine(loaded, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_bytes=48 * 737280, **kwargs), loaded=loaded)


def run(eng: LLMEngine, rid: str, params=GREEDY, **kwargs):
    eng.add_request(rid, PROMPT, params, **kwargs)
    tokens, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
            last = out
    return tokens, last


@pytest.fixture
async def cache():
    server = await serve(KVCacheSettings(port=0, shutdown_grace_s=0))
    async with KVCacheClient(server.endpoint) as client:
        yield client
    await server.stop()


async def test_prefix_served_from_the_cache_gives_the_same_tokens(loaded_model, cache):
    reference, _ = run(engine(loaded_model, enable_prefix_caching=False), "ref")

    prefill = engine(loaded_model)
    first, out = run(prefill, "p", prefill_only=True)
    assert first == reference[:1]
    assert out.finish_reason == "prefilled"
    assert await offload_prefix(prefill, cache, "p") == 5
    prefill.release("p")

    decode = engine(loaded_model)
    assert await fetch_prefix(decode, cache, PROMPT) == 80
    tokens, out = run(decode, "x")
    assert out.num_cached_tokens == 80  # only the last 3 prompt tokens were computed
    assert tokens == reference

    # The control: the same path with the fetched blocks scrambled must go wrong.
    broken = engine(loaded_model)
    assert await fetch_prefix(broken, cache, PROMPT) == 80
    broken.kv_cache.normal_()
    tokens, _ = run(broken, "y")
    assert tokens != reference


async def test_an_offloaded_prefix_is_found_only_under_its_salt(loaded_model, cache):
    eng = engine(loaded_model)
    salted = SamplingParams(max_tokens=8, temperature=0.0, cache_salt="tenant-a")
    run(eng, "p", salted, prefill_only=True)
    assert await offload_prefix(eng, cache, "p", cache_salt="tenant-a") == 5
    eng.release("p")
    assert await fetch_prefix(engine(loaded_model), cache, PROMPT) == 0
    assert await fetch_prefix(engine(loaded_model), cache, PROMPT, cache_salt="tenant-a") == 80


async def test_a_miss_leaves_the_engine_untouched(loaded_model, cache):
    eng = engine(loaded_model)
    free = eng.stats().num_free_blocks
    assert await fetch_prefix(eng, cache, PROMPT) == 0
    assert eng.stats().num_free_blocks == free and not eng.has_unfinished()


async def test_blocks_written_through_on_their_stored_events(loaded_model, cache):
    eng = engine(loaded_model)
    eng.add_request("w", PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
    stored: list[int] = []
    while eng.has_unfinished():
        eng.step()
        for kind, hashes in eng.drain_kv_events():
            if kind == "stored":
                found, snapshot = snapshot_stored_blocks(eng, hashes)
                assert await offload_snapshot(cache, eng.layout, found, snapshot) == len(found)
                stored += found
    assert len(stored) == 5
    other = engine(loaded_model)
    assert await fetch_prefix(other, cache, PROMPT) == 80
    cached = eng.block_manager.cached
    for i, h in enumerate(stored):
        assert torch.equal(
            other.kv_cache[other.block_manager.cached[h]], eng.kv_cache[cached[h]]
        ), i


async def test_a_prefix_the_engine_holds_already_is_not_fetched_again(loaded_model, cache):
    eng = engine(loaded_model)
    run(eng, "p", prefill_only=True)
    assert await offload_prefix(eng, cache, "p") == 5
    eng.release("p")
    hashes = prefix_block_hashes(PROMPT, eng.block_size, salted_root(""))
    assert eng.num_cached_prefix_blocks(hashes) == 5  # the last, partial block never is
    assert eng.num_cached_prefix_blocks(hashes[:2] + [12345] + hashes[2:]) == 2
    free = eng.stats().num_free_blocks
    calls = []

    async def call(fn, *args):
        calls.append(fn.__name__)
        return fn(*args)

    # the service has all 5 blocks, and so has the engine: counted, not copied
    assert await fetch_prefix(eng, cache, PROMPT, call=call) == 80
    assert calls == [] and eng.stats().num_free_blocks == free
    tokens, out = run(eng, "again")
    assert out.num_cached_tokens == 80
    # an engine without them fetches them, through its engine thread's calls
    other = engine(loaded_model)
    assert await fetch_prefix(other, cache, PROMPT, call=call) == 80
    assert calls == ["land_staged"]  # one engine call, no reservation across steps
