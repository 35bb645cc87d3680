"""The two attacks of issue 48 on KV, replayed against real servers.

1. A forged decode hand-off (any NATS user allowed to publish decode jobs can send one)
   names an attacker's `kv_endpoint`. The decode worker must not dial it, so the attacker
   never sees the worker's gRPC token, and the request must still be answered (the prompt
   is recomputed). A real decode worker (real engine, real NATS) and a real gRPC server
   playing the attacker, which records every call it gets.
2. Poisoning a victim's cached prefix in the KV-cache service: blocks already held under
   the victim's salted hashes are never replaced, whoever writes, and callers that are not
   workers cannot write at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.grpc_security import (
    OPERATOR,
    GrpcSecurity,
    fresh_tokens,
    open_channel,
    peers_text,
)
from tokenyard.kv.hashing import prefix_block_hashes, salted_root
from tokenyard.kv.layout import KVLayout, layout_to_proto
from tokenyard.kv.store.client import KVCacheClient, KVCacheError
from tokenyard.services.kvcache.server import KVCacheServer, serve
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.decode import DecodeHandler
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1 import kv_pb2, kv_pb2_grpc
from tokenyard.v1 import serving_pb2 as pb

TOKENS = fresh_tokens()
PEERS = peers_text(TOKENS)
GW = "gw-test"
PROMPT = [(i * 7919) % 30000 + 100 for i in range(40)]  # 3 blocks of 16 (the last part-full)
MAX_TOKENS = 6


class Attacker(grpc.GenericRpcHandler):
    """A gRPC server that serves nothing and remembers every call's method and metadata."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []

    def service(self, details: grpc.HandlerCallDetails) -> None:
        self.calls.append((str(details.method), dict(details.invocation_metadata or ())))
        return None  # UNIMPLEMENTED

    @property
    def tokens_seen(self) -> list[str]:
        return [meta.get("authorization", "") for _, meta in self.calls]


@contextlib.asynccontextmanager
async def attacker_server() -> AsyncIterator[tuple[Attacker, str]]:
    attacker = Attacker()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((attacker,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield attacker, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def decode_worker(make_engine, nats_url: str) -> AsyncIterator[WorkerBase]:
    settings = WorkerSettings(
        nats_url=nats_url, worker_id="decode-t", role="decode", heartbeat_interval_s=0.2
    )
    bus = await Bus.connect(nats_url, name="decode-t")
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
                await worker.stop()
    finally:
        await bus.close()


def greedy(make_engine, prompt: list[int]) -> list[int]:
    engine = make_engine(enable_prefix_caching=False)
    engine.add_request("ref", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


async def hand_off(bus: Bus, rid: str, first: int, kv_endpoint: str) -> list[int]:
    """Send a forged hand-off to the decode worker; the tokens it streams after ``first``."""
    chunks: list[pb.TokenChunk] = []
    finished = asyncio.Event()

    async def on_chunk(chunk: pb.TokenChunk, _msg) -> None:
        chunks.append(chunk)
        if chunk.finished:
            finished.set()

    sub = await bus.subscribe(subjects.request_tokens(GW, rid), pb.TokenChunk, on_chunk)
    forged = pb.DecodeHandoff(
        request_id=rid,
        prompt_token_ids=PROMPT,
        output_token_ids=[first],
        params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0),
        prefill_worker_id="prefill-1",
        kv_endpoint=kv_endpoint,
        src_block_ids=[0, 1, 2],
        gateway_id=GW,
    )
    ack = await bus.request(subjects.decode_jobs("decode-t"), forged, pb.HandoffAck, timeout=30)
    assert ack.accepted, ack.message
    await asyncio.wait_for(finished.wait(), 120)
    await sub.unsubscribe()
    assert not any(c.HasField("error") for c in chunks), [c.error for c in chunks]
    return [t for c in sorted(chunks, key=lambda c: c.index) for t in c.token_ids]


async def advertise(bus: Bus, worker: WorkerBase, kv_endpoint: str) -> None:
    """A heartbeat of a (fake) prefill worker that advertises ``kv_endpoint``."""
    beat = pb.WorkerHeartbeat(
        worker_id="evil", role="prefill", kv_endpoint=kv_endpoint, heartbeat_interval_ms=60_000
    )
    await bus.publish(subjects.heartbeat("prefill", "evil"), beat)
    for _ in range(100):
        if worker.presence.fleet.alive("evil", time.monotonic()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the decode worker never heard the heartbeat")


async def test_a_forged_kv_endpoint_is_never_dialled_and_the_request_is_still_answered(
    make_engine, nats_url, bus, monkeypatch
):
    monkeypatch.setenv("TOKENYARD_GRPC_TOKEN", TOKENS["decode"])
    monkeypatch.setenv("TOKENYARD_GRPC_PEERS", PEERS)
    want = greedy(make_engine, PROMPT)
    async with (
        attacker_server() as (attacker, endpoint),
        decode_worker(make_engine, nats_url) as worker,
    ):
        got = await hand_off(bus, "forged-1", want[0], endpoint)
        assert got == want[1:]  # recomputed: the same greedy answer
        assert attacker.calls == []  # never dialled, so no token seen

        # The control: once a live worker's heartbeat vouches for that endpoint, the same
        # hand-off is pulled from it with the worker's token, so the check above was the
        # only thing standing between the forged hand-off and the token.
        await advertise(bus, worker, endpoint)
        assert await hand_off(bus, "forged-2", want[0], endpoint) == want[1:]
        assert f"Bearer {TOKENS['decode']}" in attacker.tokens_seen


# --- poisoning the KV-cache service ----------------------------------------------------------

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
VICTIM_PROMPT = list(range(100, 116))  # 4 blocks of 4


def as_(identity: str | None) -> GrpcSecurity:
    return GrpcSecurity(token=TOKENS[identity] if identity else "")


@pytest.fixture
async def kvcache() -> AsyncIterator[KVCacheServer]:
    settings = KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0)
    server = await serve(settings, GrpcSecurity(peers=PEERS))
    yield server
    await server.stop()


async def put_raw(endpoint: str, identity: str, hashes: list[int], pool: torch.Tensor):
    """A Put straight on the stub, for its whole reply (stored and refused)."""
    from tokenyard.kv.checksum import crc32

    channel = open_channel(endpoint, [], as_(identity))
    desc = layout_to_proto(LAYOUT)

    async def blocks() -> AsyncIterator[kv_pb2.PutBlock]:
        for i, h in enumerate(hashes):
            data = pool[i].numpy().tobytes()
            yield kv_pb2.PutBlock(layout=desc, hash=h, data=data, crc32=crc32(data))

    try:
        return await kv_pb2_grpc.KVCacheStub(channel).Put(blocks())
    finally:
        await channel.close()


async def test_a_victims_cached_prefix_cannot_be_poisoned(kvcache):
    victim = prefix_block_hashes(VICTIM_PROMPT, LAYOUT.block_size, salted_root("tenant-blue"))
    honest = torch.randn(LAYOUT.pool_shape(4))
    async with KVCacheClient(kvcache.endpoint, security=as_("prefill")) as writer:
        assert await writer.put_blocks(LAYOUT, victim, honest, [0, 1, 2, 3]) == 4

    # A caller that is not a worker writes nothing, held or not.
    garbage = torch.full(LAYOUT.pool_shape(4), 7.0)
    fresh = prefix_block_hashes(VICTIM_PROMPT, LAYOUT.block_size, salted_root("tenant-green"))
    for identity, code in ((None, "UNAUTHENTICATED"), (OPERATOR, "PERMISSION_DENIED")):
        async with KVCacheClient(kvcache.endpoint, security=as_(identity)) as stranger:
            for hashes in (victim, fresh):
                with pytest.raises(KVCacheError, match=code):
                    await stranger.put_blocks(LAYOUT, hashes, garbage, [0, 1, 2, 3])

    # Even a worker's token (the one a forged hand-off used to leak) replaces nothing.
    reply = await put_raw(kvcache.endpoint, "decode", victim, garbage)
    assert (reply.num_stored, reply.num_refused) == (0, 4)
    same = await put_raw(kvcache.endpoint, "decode", victim, honest)
    assert (same.num_stored, same.num_refused) == (4, 0)

    async with KVCacheClient(kvcache.endpoint, security=as_("decode")) as reader:
        got = torch.zeros(LAYOUT.pool_shape(4))
        assert await reader.get_prefix(LAYOUT, victim, got, [0, 1, 2, 3]) == 4
        assert torch.equal(got, honest)
        # A reader with another salt asks other hashes: it gets none of the victim's blocks.
        other = prefix_block_hashes(VICTIM_PROMPT, LAYOUT.block_size, salted_root("tenant-red"))
        assert not set(other) & set(victim)
        assert await reader.contains(LAYOUT, other) == 0
        assert await reader.contains(LAYOUT, fresh) == 0  # nothing was planted there either
