"""Prefill workers with the KV-cache service in the serving path: a prompt computed on
worker A is written through to the service, and worker B, which never saw it, fetches
the shared prefix from the service instead of computing it; greedy tokens are unchanged.

Runs the workers' job path (PrefillHandler.run_job) over a real nats-server, a real
KV-cache server and two real engines.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.kv.hashing import prefix_block_hashes
from tokenyard.kv.store.client import KVCacheClient
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.prefill import PrefillHandler
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

BLOCK = 16
GW = "gw-test"  # the gateway this test plays
PREFIX = [(i * 7919) % 30000 + 100 for i in range(BLOCK * 10)]  # 10 full blocks
PROMPT_A = PREFIX + [501, 502, 503]
PROMPT_B = PREFIX + [777, 778, 779, 780, 781]
MAX_TOKENS = 6
KV_BYTES = 64 << 20


def greedy_reference(loaded, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    eng = LLMEngine(
        EngineConfig(kv_cache_bytes=KV_BYTES, enable_prefix_caching=False), loaded=loaded
    )
    eng.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.new_token_ids
    return tokens


@contextlib.asynccontextmanager
async def worker(loaded, nats_url: str, worker_id: str, endpoint: str, **more):
    from tokenyard.engine.sampling_params import SamplingParams as Params

    settings = WorkerSettings(
        nats_url=nats_url, worker_id=worker_id, role="both", kvcache_endpoint=endpoint, **more
    )
    engine = LLMEngine(EngineConfig(kv_cache_bytes=KV_BYTES), loaded=loaded)
    bus = await Bus.connect(nats_url, name=worker_id)
    w = WorkerBase(settings, bus, engine, Params)
    handler = PrefillHandler(w)
    try:
        async with asyncio.TaskGroup() as tg:
            await w.start(tg)
            try:
                yield w, handler
            finally:
                w.stopping.set()
                await w.stop()
    finally:
        await bus.close()


async def run(
    bus: Bus, handler: PrefillHandler, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS
) -> list[int]:
    chunks: list[pb.TokenChunk] = []

    async def on_chunk(chunk: pb.TokenChunk, _msg) -> None:
        chunks.append(chunk)

    sub = await bus.subscribe(subjects.request_tokens(GW, rid), pb.TokenChunk, on_chunk)
    job = pb.PrefillJob(
        request_id=rid,
        gateway_id=GW,
        prompt_token_ids=prompt,
        params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0),
    )
    assert await handler.run_job(job)
    await bus.sync()
    await asyncio.sleep(0.2)
    await sub.unsubscribe()
    return [t for c in sorted(chunks, key=lambda c: c.index) for t in c.token_ids]


async def test_worker_b_serves_the_shared_prefix_from_the_cache(loaded_model, nats_url, bus):
    want_a = greedy_reference(loaded_model, PROMPT_A)
    want_b = greedy_reference(loaded_model, PROMPT_B)
    server = await serve(KVCacheSettings(port=0, shutdown_grace_s=0))
    try:
        async with worker(loaded_model, nats_url, "a", server.endpoint) as (wa, a):
            assert await run(bus, a, "req-a", PROMPT_A) == want_a
            hashes = prefix_block_hashes(PREFIX, BLOCK)
            # The write-through runs in the background: wait for it.
            async with KVCacheClient(server.endpoint) as cache:
                for _ in range(100):
                    if await cache.contains(wa.engine.layout, hashes) == len(hashes):
                        break
                    await asyncio.sleep(0.05)
                assert await cache.contains(wa.engine.layout, hashes) == len(hashes)
        async with worker(loaded_model, nats_url, "b", server.endpoint) as (wb, b):
            before = wb.engine.stats().prefix_cache_hits
            assert await run(bus, b, "req-b", PROMPT_B) == want_b
            # Every full block of the shared prefix came from the service: B never saw it.
            assert wb.engine.stats().prefix_cache_hits - before >= len(PREFIX)
    finally:
        await server.stop()


async def test_an_unreachable_cache_never_fails_the_request(loaded_model, nats_url, bus):
    want = greedy_reference(loaded_model, PROMPT_A)
    async with worker(loaded_model, nats_url, "c", "127.0.0.1:1") as (_, c):
        assert await run(bus, c, "req-c", PROMPT_A) == want


async def wait_contains(endpoint: str, layout, hashes: list[int]) -> int:
    """How many leading ``hashes`` the service holds once the background offload settled."""
    async with KVCacheClient(endpoint) as cache:
        n = 0
        for _ in range(100):
            n = await cache.contains(layout, hashes)
            if n == len(hashes):
                break
            await asyncio.sleep(0.05)
        return n


async def test_a_reply_is_offloaded_and_the_next_turn_fetches_it(loaded_model, nats_url, bus):
    # Turn 1 on worker a; turn 2 (turn 1's prompt and reply, then a new message) on worker
    # b, which never saw either: every full block of both comes from the service.
    reply_len = 40
    reply = greedy_reference(loaded_model, PROMPT_A, reply_len)
    turn2 = PROMPT_A + reply + [901, 902, 903]
    want2 = greedy_reference(loaded_model, turn2)
    server = await serve(KVCacheSettings(port=0, shutdown_grace_s=0))
    try:
        async with worker(loaded_model, nats_url, "a", server.endpoint) as (wa, a):
            assert await run(bus, a, "turn-1", PROMPT_A, reply_len) == reply
            # The reply's last token was never computed: the blocks full before it.
            history = prefix_block_hashes(PROMPT_A + reply[:-1], BLOCK)
            assert len(history) > len(PROMPT_A) // BLOCK  # the reply filled blocks of its own
            assert await wait_contains(server.endpoint, wa.engine.layout, history) == len(history)
        async with worker(loaded_model, nats_url, "b", server.endpoint) as (wb, b):
            before = wb.engine.stats().prefix_cache_hits
            assert await run(bus, b, "turn-2", turn2) == want2
            assert wb.engine.stats().prefix_cache_hits - before == len(history) * BLOCK
    finally:
        await server.stop()


async def test_offload_over_the_budget_is_dropped_and_counted(loaded_model, nats_url, bus):
    from tokenyard.services.worker.metrics import KV_OFFLOAD_DROPPED_BYTES

    server = await serve(KVCacheSettings(port=0, shutdown_grace_s=0))
    try:
        # One byte a second: not one block fits.
        async with worker(
            loaded_model, nats_url, "d", server.endpoint, kv_offload_bytes_per_s=1
        ) as (wd, d):
            labels = {**wd.metrics.labels, "source": "prompt"}
            before = KV_OFFLOAD_DROPPED_BYTES.labels(**labels)._value.get()
            await run(bus, d, "req-d", PROMPT_A)
            await asyncio.sleep(0.3)
            dropped = KV_OFFLOAD_DROPPED_BYTES.labels(**labels)._value.get() - before
            assert dropped == len(PROMPT_A) // BLOCK * wd.engine.layout.block_nbytes
            async with KVCacheClient(server.endpoint) as cache:
                hashes = prefix_block_hashes(PROMPT_A, BLOCK)
                assert await cache.contains(wd.engine.layout, hashes) == 0
    finally:
        await server.stop()


async def test_a_worker_fetches_only_the_blocks_it_does_not_hold(loaded_model, nats_url, bus):
    # Worker b computed the prefix's first 4 blocks itself; the service holds all 10 (from
    # worker a). b's fetch moves the other 6 only, lands them at the request's add (no
    # blocks reserved across steps) and the greedy tokens are those of a full compute.
    head = PREFIX[: 4 * BLOCK] + [11, 12, 13]
    want_head = greedy_reference(loaded_model, head)
    want_b = greedy_reference(loaded_model, PROMPT_B)
    server = await serve(KVCacheSettings(port=0, shutdown_grace_s=0))
    try:
        async with worker(loaded_model, nats_url, "a", server.endpoint) as (wa, a):
            await run(bus, a, "req-a", PROMPT_A)
            hashes = prefix_block_hashes(PREFIX, BLOCK)
            assert await wait_contains(server.endpoint, wa.engine.layout, hashes) == len(hashes)
        async with worker(loaded_model, nats_url, "b", server.endpoint) as (wb, b):
            assert await run(bus, b, "head", head) == want_head
            assert wb.engine.num_cached_prefix_blocks(hashes) == 4
            fetched = wb.metrics.kv_fetch_bytes  # the head's own fetch, if any
            before = wb.engine.stats().prefix_cache_hits
            assert await run(bus, b, "req-b", PROMPT_B) == want_b
            layout = wb.engine.layout
            assert wb.metrics.kv_fetch_bytes - fetched == 6 * layout.block_nbytes
            assert wb.engine.stats().prefix_cache_hits - before == len(PREFIX)
            assert wb.engine.num_cached_prefix_blocks(hashes) == len(hashes)
            wb.engine.block_manager.check_no_leaks()
    finally:
        await server.stop()
