"""The router's block index rebuilt from the worker after it lost KV events, on a real
nats-server with a real-engine worker: a restarted router (it knows nothing) and a router
that missed events (a gap) both end with the blocks the worker's prefix cache really holds.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from worker_client import Heartbeats, Request, connect, wait_router

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.kv.hashing import HASH_SPEC_VERSION, prefix_block_hashes
from tokenyard.routing.policy import PolicyConfig
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.services.router.handler import RouterHandler
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

WORKER = "both-1"
BLOCK = 16


def prompt(i: int, n: int = 70) -> list[int]:
    """A prompt of its own (no block shared with another), 4 full blocks and a bit."""
    return [(i * 7919 + k * 104729) % 30000 + 100 for k in range(n)]


@pytest.fixture(scope="module")
def stack(launch_stack):
    config = StackConfig(
        aggregated=True,
        gateway=False,
        kvcache=False,
        facilities=False,
        telemetry=False,
        worker_env={
            "TOKENYARD_WORKER_HEARTBEAT_INTERVAL_S": "0.5",
            "TOKENYARD_WORKER_KV_CACHE_BYTES": str(64 << 20),  # nothing is evicted here
        },
    )
    with launch_stack(config) as s:
        yield s


async def ready_bus(stack: LocalStack) -> Bus:
    bus = await connect(stack.nats_url)
    beats = await Heartbeats().start(bus)
    assert await beats.wait_for(lambda b: WORKER in b, 300), stack.describe_failures()
    await wait_router(bus, placeable=True, timeout=60)
    return bus


async def serve(bus: Bus, prompts: list[list[int]]) -> None:
    """Run each prompt on the worker (one output token: only the prompt's KV is computed)."""
    for p in prompts:
        req = Request(bus, p, pb.SamplingParams(max_tokens=1, temperature=0.0))
        reply = await req.submit()
        assert reply.WhichOneof("result") == "placement", reply
        await req.wait(120)


async def worker_blocks(bus: Bus) -> set[int]:
    """What the worker's prefix cache holds, asked of the worker itself."""
    request = pb.KVResyncRequest(worker_id=WORKER, reason="test")
    dump = await bus.request(subjects.kv_resync(WORKER), request, pb.KVDump, timeout=10)
    assert dump.worker_id == WORKER and dump.hash_version == HASH_SPEC_VERSION
    return set(dump.block_hashes)


def hashes(prompts: list[list[int]]) -> set[int]:
    return {h for p in prompts for h in prefix_block_hashes(p, BLOCK)}


async def cached_tokens(bus: Bus, p: list[int]) -> int:
    """What the stack's router expects to find cached for this prompt on the worker."""
    req = pb.RouteRequest(
        request_id=f"probe-{time.monotonic_ns()}",
        num_prompt_tokens=len(p),
        block_hashes=prefix_block_hashes(p, BLOCK),
        hash_version=HASH_SPEC_VERSION,
        max_tokens=1,
    )
    reply = await bus.request(subjects.ROUTER_ROUTE, req, pb.RouteReply, timeout=5)
    return reply.placement.expected_cached_tokens


async def eventually(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.2)
    return bool(await predicate())


async def test_a_restarted_router_rebuilds_its_index_from_the_worker(stack):
    bus = await ready_bus(stack)
    try:
        prompts = [prompt(i) for i in range(3)]
        await serve(bus, prompts)
        assert hashes(prompts) <= await worker_blocks(bus)
        full = len(prefix_block_hashes(prompts[0], BLOCK)) * BLOCK
        assert await eventually(lambda: _all_cached(bus, prompts, full))

        router = next(p for p in stack.procs if p.name == "router")
        router.kill()  # kill -9: its index is gone
        assert await eventually(lambda: _restarted(stack), 60), stack.describe_failures()
        await wait_router(bus, placeable=True, timeout=60)
        # No KV event comes (the worker is idle): only its heartbeat can tell the new router.
        assert await eventually(lambda: _all_cached(bus, prompts, full)), (
            f"{[await cached_tokens(bus, p) for p in prompts]} != {full}"
        )
    finally:
        await bus.close()


async def _all_cached(bus: Bus, prompts: list[list[int]], full: int) -> bool:
    return all([await cached_tokens(bus, p) == full for p in prompts])


async def _restarted(stack: LocalStack) -> bool:
    stack.supervise()
    return all(p.alive() for p in stack.procs)


async def test_a_router_that_missed_events_asks_for_a_dump(stack):
    bus = await ready_bus(stack)
    handler = RouterHandler(bus, PolicyConfig())  # a router of the test's own, on the bus
    try:
        await bus.subscribe(subjects.HEARTBEATS_ALL, pb.WorkerHeartbeat, handler.on_heartbeat)
        events = await bus.subscribe(subjects.KV_EVENTS_ALL, pb.KVEvent, handler.on_kv_event)

        async def following() -> bool:
            s = handler.kv.streams.get(WORKER)
            return s is not None and bool(s.epoch) and not s.resyncing

        assert await eventually(following)
        assert handler.index.blocks_of(WORKER) == await worker_blocks(bus)

        await events.unsubscribe()  # the events of the next two requests never reach it
        await bus.sync()
        missed = [prompt(i) for i in range(10, 12)]
        await serve(bus, missed)
        assert not hashes(missed) & handler.index.blocks_of(WORKER)
        await bus.subscribe(subjects.KV_EVENTS_ALL, pb.KVEvent, handler.on_kv_event)
        await bus.sync()
        await serve(bus, [prompt(20)])  # its event comes after a gap

        async def rebuilt() -> bool:
            return handler.index.blocks_of(WORKER) == await worker_blocks(bus)

        assert await eventually(rebuilt)
        assert hashes([*missed, prompt(20)]) <= handler.index.blocks_of(WORKER)
        assert handler.kv.streams[WORKER].seq > 0
    finally:
        await handler.close()
        await bus.close()
