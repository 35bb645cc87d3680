"""Workers over a real nats-server, with the fake engine: queueing, redelivery, cancel.

Each test starts its own embedded NATS, router and worker processes (LocalStack, no
gateway); a small client in worker_client.py plays the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import pytest
from worker_client import Heartbeats, Request, connect, wait_disaggregated, wait_router

from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.services.worker.fake_engine import next_token
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


async def test_disaggregated_request_through_both_workers(stack_factory):
    stack = stack_factory(1, 1)
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
