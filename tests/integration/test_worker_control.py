"""A worker's gRPC control API on a real stack (NATS, router, two fake-engine workers):
drain one, watch it finish its request, take no new work and report DRAINED; undrain it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from worker_client import Heartbeats, Request, connect, wait_router

from tokenyard.grpc_security import GrpcSecurity, open_channel
from tokenyard.services.launch.stack import StackConfig
from tokenyard.services.worker.fake_engine import next_token
from tokenyard.v1 import control_pb2 as cpb
from tokenyard.v1 import control_pb2_grpc
from tokenyard.v1 import serving_pb2 as pb

PROMPT = list(range(1, 50))
Status = cpb.WorkerStatus


def expected(prompt: list[int], n: int) -> list[int]:
    out, last = [], prompt[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


CONFIG = StackConfig(
    prefill=2,
    decode=0,  # two aggregated workers: each runs whole requests
    engine="fake",
    gateway=False,
    kvcache=False,
    facilities=False,
    telemetry=False,
    worker_env={
        "TOKENYARD_WORKER_HEARTBEAT_INTERVAL_S": "0.3",
        "TOKENYARD_WORKER_FAKE_STEP_S": "0.05",
    },
)


def control(
    endpoint: str, token: str
) -> tuple[grpc.aio.Channel, control_pb2_grpc.WorkerControlStub]:
    channel = open_channel(endpoint, [], GrpcSecurity(token=token))
    return channel, control_pb2_grpc.WorkerControlStub(channel)


@pytest.mark.slow
async def test_drain_a_worker_then_undrain_it(launch_stack):
    with launch_stack(CONFIG) as stack:
        bus = await connect(stack.nats_url)
        beats = await Heartbeats().start(bus)
        assert await beats.wait_for(
            lambda b: len(b) == 2 and all(hb.control_endpoint for hb in b.values()), 30
        ), "workers did not announce their control endpoints"
        await wait_router(bus, placeable=True)

        long = Request(bus, PROMPT, pb.SamplingParams(max_tokens=60))
        victim = (await long.submit()).placement.prefill_worker_id
        await long.first_chunk.wait()
        channel, worker = control(beats.latest[victim].control_endpoint, stack.grpc_token)

        status = await worker.Drain(cpb.WorkerDrainRequest(reason="test"))
        assert status.worker_id == victim and status.state == Status.DRAINING
        assert status.drain_reason == "test" and status.num_requests == 1
        assert await beats.wait_for(lambda b: b[victim].draining, 10)
        await asyncio.sleep(0.3)  # the router has that heartbeat too by now

        # New work goes to the other worker while the drained one finishes its request.
        for _ in range(3):
            other = Request(bus, PROMPT, pb.SamplingParams(max_tokens=4))
            assert (await other.submit()).placement.prefill_worker_id != victim
            assert (await other.wait(30)).token_ids == expected(PROMPT, 4)
        result = await long.wait(60)
        assert result.token_ids == expected(PROMPT, 60) and result.last.worker_id == victim

        status = await worker.Drain(cpb.WorkerDrainRequest(wait_s=30))
        assert status.state == Status.DRAINED and status.num_running == 0
        assert status.drain_reason == "test"  # a second drain keeps the first reason

        # Idle, it still gets nothing: not even when the other worker is the busier one.
        busy = Request(bus, PROMPT, pb.SamplingParams(max_tokens=40))
        assert (await busy.submit()).placement.prefill_worker_id != victim
        await busy.first_chunk.wait()
        extra = Request(bus, PROMPT, pb.SamplingParams(max_tokens=4))
        assert (await extra.submit()).placement.prefill_worker_id != victim
        assert (await extra.wait(30)).token_ids == expected(PROMPT, 4)
        await busy.wait(60)
        assert (await worker.Status(cpb.WorkerStatusRequest())).state == Status.DRAINED

        status = await worker.Undrain(cpb.WorkerUndrainRequest())
        assert status.state == Status.SERVING and not status.drain_reason
        assert await beats.wait_for(lambda b: not b[victim].draining, 10)

        # Without the stack's token the worker answers nothing.
        stranger_channel, stranger = control(beats.latest[victim].control_endpoint, "")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stranger.Drain(cpb.WorkerDrainRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await worker.Status(cpb.WorkerStatusRequest())).state == Status.SERVING

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.Drain(cpb.WorkerDrainRequest(wait_s=1e9))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await worker.Status(cpb.WorkerStatusRequest())).state == Status.SERVING

        await stranger_channel.close()
        await channel.close()
        await bus.close()
