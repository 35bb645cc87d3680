"""Workers over a real nats-server, with the fake engine: queueing, redelivery, cancel.

Each test that kills, stops or slows a worker starts its own embedded NATS, router and
worker processes (LocalStack, no gateway); the tests that only send a request and read it
back share one such stack. A small client in worker_client.py plays the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator

import pytest
from worker_client import Heartbeats, Request, connect, wait_disaggregated, wait_router

from tokenyard.services.gateway.backend import NatsBackend
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.services.worker.fake_engine import fake_embedding, next_token
from tokenyard.v1 import serving_pb2 as pb

FAST = {
    "TOKENYARD_WORKER_HEARTBEAT_INTERVAL_S": "0.5",
    "TOKENYARD_WORKER_JOB_ACK_WAIT_S": "2",
    "TOKENYARD_WORKER_DRAIN_TIMEOUT_S": "2",  # shorter than the requests the stop tests cut
}
PROMPT = list(range(1, 50))


def expected(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


def fake_config(
    prefill: int, decode: int, *, step_s: float = 0.005, disaggregation: str = "always"
) -> StackConfig:
    return StackConfig(
        prefill=prefill,
        decode=decode,
        engine="fake",
        gateway=False,
        kvcache=False,
        facilities=False,
        telemetry=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": disaggregation},
        worker_env={**FAST, "TOKENYARD_WORKER_FAKE_STEP_S": str(step_s)},
    )


async def wait_workers(bus, n: int, *, placeable: bool = True) -> Heartbeats:
    beats = await Heartbeats().start(bus)
    assert await beats.wait_for(lambda b: len(b) >= n, 30), "workers did not come up"
    await wait_router(bus, placeable=placeable)
    return beats


@pytest.fixture
def stack_factory(launch_stack):
    """stack_factory(prefill, decode, ...): a fake-engine stack, stopped after the test."""
    with contextlib.ExitStack() as stacks:

        def make(*args, **kwargs) -> LocalStack:
            return stacks.enter_context(launch_stack(fake_config(*args, **kwargs)))

        yield make


@pytest.fixture(scope="module")
def plain_stack(launch_stack) -> Iterator[LocalStack]:
    """One prefill and one decode worker at the default fake step, for the tests that only
    send a request and read its answer: they leave the stack as they found it."""
    with launch_stack(fake_config(1, 1)) as stack:
        yield stack


async def test_disaggregated_request_through_both_workers(plain_stack):
    stack = plain_stack
    bus = await connect(stack.nats_url)
    await wait_workers(bus, 2)
    await wait_disaggregated(bus, PROMPT)
    req = Request(bus, PROMPT, pb.SamplingParams(max_tokens=12))
    reply = await req.submit()
    assert reply.placement.disaggregated
    result = await req.wait(20)
    assert result.token_ids == expected(PROMPT, 12)
    assert result.chunks[0].worker_id == "prefill-1" and result.last.worker_id == "decode-2"
    assert result.last.finish_reason == "length" and result.last.num_output_tokens == 12
    await bus.close()


async def test_a_pooling_request_runs_whole_on_the_prefill_worker(plain_stack):
    """An embedding: no hand-off (though the router disaggregates), no token, one vector."""
    stack = plain_stack
    bus = await connect(stack.nats_url)
    await wait_workers(bus, 2)
    await wait_disaggregated(bus, PROMPT)
    req = Request(bus, PROMPT, pb.SamplingParams(max_tokens=1, pooling="mean"))
    await req.submit()
    result = await req.wait(20)
    assert result.token_ids == [] and len(result.chunks) == 1
    assert result.last.finished and result.last.finish_reason == "stop"
    assert result.last.worker_id == "prefill-1"
    assert list(result.last.embedding) == pytest.approx(fake_embedding(PROMPT, "mean"))
    await bus.close()


async def test_no_workers_is_a_route_error(stack_factory):
    stack = stack_factory(0, 1)
    bus = await connect(stack.nats_url)
    await wait_workers(bus, 1, placeable=False)  # only a decode worker: nobody can prefill
    reply = await Request(bus, PROMPT, pb.SamplingParams()).route()
    assert reply.WhichOneof("result") == "error"
    assert reply.error.code == pb.RouteError.NO_WORKERS
    await bus.close()


async def test_job_of_a_killed_worker_is_redelivered_to_another(stack_factory):
    # Aggregated (no decode pool): the prefill worker runs the whole, slow request.
    stack = stack_factory(2, 0, step_s=0.1)
    bus = await connect(stack.nats_url)
    await wait_workers(bus, 2)
    req = Request(bus, PROMPT, pb.SamplingParams(max_tokens=40))
    reply = await req.submit()
    victim = reply.placement.prefill_worker_id
    await req.first_chunk.wait()
    next(p for p in stack.workers if p.name == victim).kill()  # kill -9, mid-job, unacked
    result = await req.wait(40)
    assert result.token_ids == expected(PROMPT, 40)
    assert result.last.finished and result.last.finish_reason == "length"
    assert result.last.worker_id != victim
    await bus.close()


async def test_cancel_frees_the_blocks(stack_factory):
    stack = stack_factory(1, 1, step_s=0.05)
    bus = await connect(stack.nats_url)
    beats = await wait_workers(bus, 2)
    await wait_disaggregated(bus, PROMPT)
    total = beats.latest["decode-2"].num_blocks
    req = Request(bus, PROMPT, pb.SamplingParams(max_tokens=500))
    await req.submit()
    assert await beats.wait_for(lambda b: b["decode-2"].num_free_blocks < total, 20)
    await req.cancel()
    result = await req.wait(10)
    assert result.last.finish_reason == "abort"
    assert len(result.token_ids) < 500
    assert await beats.wait_for(
        lambda b: all(h.num_free_blocks == h.num_blocks for h in b.values()), 10
    )
    await bus.close()


async def test_stopping_decode_worker_hands_its_sequences_to_another(stack_factory):
    stack = stack_factory(1, 2, step_s=0.05)
    bus = await connect(stack.nats_url)
    await wait_workers(bus, 3)
    await wait_disaggregated(bus, PROMPT)
    req = Request(bus, PROMPT, pb.SamplingParams(max_tokens=150))
    reply = await req.submit()
    decoder = next(p for p in stack.workers if p.name == reply.placement.decode_worker_id)
    while len(req.result.tokens) < 10:
        await asyncio.sleep(0.05)
    decoder.signal(signal.SIGTERM)  # it cannot finish the 140 steps left within its 2 s drain
    result = await req.wait(30)
    assert result.token_ids == expected(PROMPT, 150)
    assert result.last.finish_reason == "length"
    assert result.last.worker_id not in (decoder.name, "prefill-1")
    await asyncio.to_thread(decoder.proc.wait, 10)
    await bus.close()


async def test_stopping_prefill_worker_hands_back_its_job(stack_factory):
    stack = stack_factory(2, 0, step_s=0.1)
    bus = await connect(stack.nats_url)
    await wait_workers(bus, 2)
    req = Request(bus, PROMPT, pb.SamplingParams(max_tokens=100))
    reply = await req.submit()
    victim = next(p for p in stack.workers if p.name == reply.placement.prefill_worker_id)
    await req.first_chunk.wait()
    victim.signal(signal.SIGTERM)
    result = await req.wait(90)
    assert result.token_ids == expected(PROMPT, 100)
    assert result.last.worker_id != victim.name
    await bus.close()


# --- a worker killed with many streams in flight: nothing lost ----------------------------

CHAOS_STREAMS = 12
CHAOS_TOKENS = 80


def chaos_prompt(i: int) -> list[int]:
    return [*PROMPT, 100 + i]  # the fake engine's tokens follow the prompt's last one


async def read_all(stream) -> list[int]:
    tokens: list[int] = []
    async for chunk in stream:
        tokens += chunk.token_ids
    await stream.close()
    return tokens


async def keep_restarting(stack: LocalStack, stop: asyncio.Event) -> None:
    while not stop.is_set():
        stack.supervise()
        await asyncio.sleep(0.2)


async def streams_through_a_kill(stack: LocalStack, victim: str) -> list[list[int] | BaseException]:
    """12 streams through the gateway's own NATS side; ``victim`` is killed (-9) once they
    are all decoding and restarted by the supervisor; each stream's tokens, in order, or
    the error that ended it."""
    settings = GatewaySettings(
        nats_url=stack.nats_url, dead_worker_grace_s=1.0, prefill_redelivery_grace_s=90
    )
    backend = NatsBackend(settings)
    await backend.start()
    stop = asyncio.Event()
    supervisor = asyncio.create_task(keep_restarting(stack, stop))
    try:
        want = {p.name for p in stack.workers}
        async with asyncio.timeout(60):
            while not want <= {w.worker_id for w in backend.fleet.live(time.monotonic())}:
                await asyncio.sleep(0.1)
        assert backend.bus is not None
        await wait_router(backend.bus, placeable=True)
        params = pb.SamplingParams(max_tokens=CHAOS_TOKENS, ignore_eos=True)
        streams = [
            await backend.submit(f"chaos-{i}", "", chaos_prompt(i), params)
            for i in range(CHAOS_STREAMS)
        ]
        readers = [asyncio.create_task(read_all(s)) for s in streams]
        await asyncio.sleep(1.0)  # all in decode: ~20 steps of 80
        assert not any(r.done() for r in readers), "the streams ended before the kill"
        next(p for p in stack.procs if p.name == victim).kill()
        killed_at = time.monotonic()
        async with asyncio.timeout(150):
            got = await asyncio.gather(*readers, return_exceptions=True)
        print(f"{victim} killed: the streams ended {time.monotonic() - killed_at:.1f} s later")
        return got
    finally:
        stop.set()
        await supervisor
        await backend.stop()


CHAOS_LAYOUTS = {
    "one-worker": (dict(prefill=1, decode=0, aggregated=True), "both-1"),
    "split-decode-killed": (dict(prefill=1, decode=1), "decode-2"),
    "split-prefill-killed": (dict(prefill=1, decode=1), "prefill-1"),
    "split-2d-decode-killed": (dict(prefill=1, decode=2), "decode-3"),
}


@pytest.mark.parametrize("layout", list(CHAOS_LAYOUTS))
async def test_no_stream_is_lost_to_a_killed_worker(launch_stack, layout):
    """JetStream redelivers the jobs of a killed worker that decoded them itself, while the
    gateway resumes its streams: both may reach the same (restarted) worker, which runs the
    request once. On one worker the gateway holds the streams until it is back."""
    shape, victim = CHAOS_LAYOUTS[layout]
    config = fake_config(shape["prefill"], shape["decode"], step_s=0.05)
    config.aggregated = bool(shape.get("aggregated"))
    with launch_stack(config) as stack:
        got = await streams_through_a_kill(stack, victim)
        lost = {
            i: repr(tokens)[:200]
            for i, tokens in enumerate(got)
            if tokens != expected(chaos_prompt(i), CHAOS_TOKENS)
        }
        assert not lost, f"{len(lost)} of {CHAOS_STREAMS} streams lost or wrong: {lost}"
        assert stack.supervisor.records[victim].restarts == 1
