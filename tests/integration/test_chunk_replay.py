"""Token chunks lost on the way come back. Core NATS drops what is published while a
subscriber's server restarts, so the gateway's stream asks the request's workers to send
again from its first gap (`ty.replay.<gateway>.<request>`), and the worker's stream publishes
again what it sent. On a real nats-server; the loss is played by the gateway's subscription
dropping what arrives while it is told to (`deaf`)."""

from __future__ import annotations

import asyncio

import pytest

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.outputs import RequestOutput
from tokenyard.fleet import FleetView
from tokenyard.services.gateway.backend import NatsTokenStream
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.worker.stream import TokenStream
from tokenyard.v1 import serving_pb2 as pb

GATEWAY = "gw-replay"


def output(rid: str, ids: list[int], *, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        new_token_ids=ids,
        new_text="".join(chr(ord("a") + i) for i in ids),
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=0,
        num_cached_tokens=0,
    )


async def gateway_stream(
    bus: Bus, rid: str, asked: list[int], reconnects: list[int], deaf: list[bool]
) -> NatsTokenStream:
    queue: asyncio.Queue[pb.TokenChunk] = asyncio.Queue()

    async def on_chunk(chunk: pb.TokenChunk, _msg: object) -> None:
        if not deaf[0]:
            queue.put_nowait(chunk)

    async def replay(from_index: int) -> None:
        asked.append(from_index)
        await bus.publish(
            subjects.replay(GATEWAY, rid), pb.Replay(request_id=rid, from_index=from_index)
        )

    sub = await bus.subscribe(subjects.request_tokens(GATEWAY, rid), pb.TokenChunk, on_chunk)
    placement = pb.Placement(prefill_worker_id="w1", decode_worker_id="w1")
    settings = GatewaySettings(instance_id=GATEWAY, idle_timeout_s=30)
    return NatsTokenStream(
        [sub],
        queue,
        placement,
        FleetView(),
        settings,
        replay=replay,
        reconnects=lambda: reconnects[0],
    )


async def worker_stream(nats_url: str, rid: str) -> tuple[Bus, TokenStream]:
    bus = await Bus.connect(nats_url, name="worker")
    stream = TokenStream(bus, "w1", GATEWAY, rid, lambda ids: "")
    stream.bus.publish = flushed(bus)  # type: ignore[method-assign]

    async def on_replay(replay: pb.Replay, _msg: object) -> None:
        if replay.request_id == rid:
            await stream.replay(replay.from_index)

    await bus.subscribe(subjects.REPLAY_ALL, pb.Replay, on_replay)
    await bus.sync()
    return bus, stream


async def read_all(stream: NatsTokenStream) -> list[pb.TokenChunk]:
    return [chunk async for chunk in stream]


def flushed(bus: Bus):
    """Publish and wait until the server has it, so that `deaf` switches between chunks."""
    publish = bus.publish

    async def publish_and_flush(*args, **kwargs) -> None:
        await publish(*args, **kwargs)
        await bus.sync()

    return publish_and_flush


async def test_a_gap_is_filled_by_a_replay_from_its_start(bus: Bus, nats_url: str):
    rid = "req-gap"
    worker_bus, worker = await worker_stream(nats_url, rid)
    deaf = [True]
    asked: list[int] = []
    try:
        stream = await gateway_stream(bus, rid, asked, [0], deaf)
        await bus.sync()
        await worker.on_output(output(rid, [0]))  # lost
        await worker.on_output(output(rid, [1, 2]))  # lost
        await asyncio.sleep(0.2)  # the gateway's connection has read (and dropped) them
        deaf[0] = False
        await worker.on_output(output(rid, [3], finished=True))  # arrives, after a gap
        chunks = await asyncio.wait_for(read_all(stream), 20)
        await stream.close()
    finally:
        await worker_bus.close()
    assert [c.index for c in chunks] == [0, 1, 3]
    assert [t for c in chunks for t in c.token_ids] == [0, 1, 2, 3]
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert asked and asked[0] == 0  # from the first missing index


async def test_after_a_reconnect_a_silent_stream_asks_for_its_tail(bus: Bus, nats_url: str):
    rid = "req-tail"
    worker_bus, worker = await worker_stream(nats_url, rid)
    reconnects, deaf = [0], [False]
    asked: list[int] = []
    try:
        stream = await gateway_stream(bus, rid, asked, reconnects, deaf)
        await bus.sync()
        await worker.on_output(output(rid, [5, 6]))
        first = await asyncio.wait_for(anext(stream), 20)
        assert first.index == 0
        # The last chunk is sent while the gateway's server is away: no gap to see, only
        # silence and the bus's reconnect count.
        deaf[0] = True
        await worker.on_output(output(rid, [7], finished=True))
        await asyncio.sleep(0.2)
        deaf[0] = False
        with pytest.raises(TimeoutError):  # silence alone is not a loss: a slow step is silent
            await asyncio.wait_for(anext(stream), 2.5)
        assert asked == []
        reconnects[0] += 1
        rest = await asyncio.wait_for(read_all(stream), 20)
        await stream.close()
    finally:
        await worker_bus.close()
    assert [c.index for c in rest] == [2] and rest[0].finished
    assert asked[0] == 2
