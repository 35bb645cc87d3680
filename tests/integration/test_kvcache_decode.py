"""A disaggregated decode worker sends a finished reply's KV blocks to the KV-cache service,
under the request's salted hashes, so a chat's next turn finds them wherever it is placed
(the prefill worker sent the prompt's blocks; the reply's exist only on the decode worker).

A real decode worker (real engine, real NATS) takes a hand-off and a real KV-cache server
keeps what it sends. The hand-off names no KV endpoint, so the decode worker recomputes the
prompt: what it holds then is the same as after a pull.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.kv.hashing import prefix_block_hashes, salted_root
from tokenyard.kv.store.client import KVCacheClient
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.decode import DecodeHandler
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow  # the real model decodes 40 tokens: 75 s here, 197 s under load

GW = "gw-test"
WORKER = "decode-kv"
BLOCK = 16
PROMPT = [(i * 7919) % 30000 + 100 for i in range(40)]  # 2 full blocks and 8 tokens
MAX_TOKENS = 40  # the reply fills the third block and a fourth
SALT = "tenant-a"


@contextlib.asynccontextmanager
async def decode_worker(make_engine, nats_url: str, endpoint: str) -> AsyncIterator[WorkerBase]:
    settings = WorkerSettings(
        nats_url=nats_url, worker_id=WORKER, role="decode", kvcache_endpoint=endpoint
    )
    bus = await Bus.connect(nats_url, name=WORKER)
    worker = WorkerBase(settings, bus, make_engine(), SamplingParams)
    handler = DecodeHandler(worker)
    try:
        async with asyncio.TaskGroup() as tg:
            await worker.start(tg)
            await handler.start(tg)
            try:
                yield worker
            finally:
                worker.stopping.set()
                await handler.stop_taking()
                await worker.stop()
    finally:
        await bus.close()


async def hand_off(bus: Bus, rid: str) -> list[int]:
    """Hand PROMPT (its first token made up) to the decode worker; every token it streams."""
    chunks: list[pb.TokenChunk] = []
    finished = asyncio.Event()

    async def on_chunk(chunk: pb.TokenChunk, _msg) -> None:
        chunks.append(chunk)
        if chunk.finished:
            finished.set()

    sub = await bus.subscribe(subjects.request_tokens(GW, rid), pb.TokenChunk, on_chunk)
    handoff = pb.DecodeHandoff(
        request_id=rid,
        prompt_token_ids=PROMPT,
        output_token_ids=[PROMPT[0]],
        params=pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True, cache_salt=SALT
        ),
        prefill_worker_id="prefill-1",
        gateway_id=GW,
    )
    ack = await bus.request(subjects.decode_jobs(WORKER), handoff, pb.HandoffAck, timeout=30)
    assert ack.accepted, ack.message
    await asyncio.wait_for(finished.wait(), 120)
    await sub.unsubscribe()
    assert not any(c.HasField("error") for c in chunks), [c.error for c in chunks]
    return [PROMPT[0], *(t for c in sorted(chunks, key=lambda c: c.index) for t in c.token_ids)]


async def held(client: KVCacheClient, layout, hashes: list[int]) -> int:
    """How many leading ``hashes`` the service holds once the background offload settled."""
    n = 0
    for _ in range(100):
        n = await client.contains(layout, hashes)
        if n == len(hashes):
            break
        await asyncio.sleep(0.05)
    return n


async def test_a_decode_worker_offloads_the_reply_it_decoded(make_engine, nats_url, bus):
    server = await serve(KVCacheSettings(port=0, shutdown_grace_s=0))
    try:
        async with (
            decode_worker(make_engine, nats_url, server.endpoint) as worker,
            KVCacheClient(server.endpoint) as client,
        ):
            output = await hand_off(bus, "turn-1")
            assert len(output) == MAX_TOKENS
            layout = worker.engine.layout
            # The last token's KV was never computed: the blocks full before it.
            history = prefix_block_hashes(PROMPT + output[:-1], BLOCK, salted_root(SALT))
            reply = history[len(PROMPT) // BLOCK :]
            assert len(reply) == 2
            assert await held(client, layout, reply) == len(reply)
            # Only the reply: the prompt's blocks are the prefill worker's to send.
            assert await client.contains(layout, history) == 0
            # Under the request's salt only: another tenant's turn finds nothing.
            unsalted = prefix_block_hashes(PROMPT + output[:-1], BLOCK)
            assert await client.contains(layout, unsalted[len(PROMPT) // BLOCK :]) == 0
    finally:
        await server.stop()
