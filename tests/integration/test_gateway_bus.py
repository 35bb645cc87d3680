"""The gateway's NATS side against a real nats-server: a scripted router and worker stand in
for the real ones, so ordering, redelivered chunks, errors and cancels are exact."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenyard.api_errors import ApiError
from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.services.gateway.backend import NatsBackend
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.v1 import serving_pb2 as pb

WORKER = "fw1"


@pytest.fixture
async def backend(nats_url):
    settings = GatewaySettings(
        nats_url=nats_url,
        dead_worker_grace_s=0.5,
        prefill_redelivery_grace_s=1.0,
        idle_timeout_s=5,
        route_timeout_s=1,
    )
    backend = NatsBackend(settings)
    await backend.start()
    yield backend
    await backend.stop()


async def serve_router(bus: Bus, reply: pb.RouteReply, seen: list[pb.RouteRequest]):
    async def on_route(req: pb.RouteRequest, msg) -> None:
        seen.append(req)
        await bus.reply(msg, reply)

    sub = await bus.subscribe(subjects.ROUTER_ROUTE, pb.RouteRequest, on_route)
    await bus.sync()
    return sub


PLACED = pb.RouteReply(placement=pb.Placement(prefill_worker_id=WORKER, decode_worker_id=WORKER))


async def take_job(bus: Bus) -> pb.PrefillJob:
    sub = await bus.js.pull_subscribe(
        subjects.prefill_worker_jobs(WORKER), durable=WORKER, stream=subjects.PREFILL_STREAM
    )
    (msg,) = await sub.fetch(1, timeout=5)
    await msg.ack()
    job = pb.PrefillJob()
    job.ParseFromString(msg.data)
    return job


def chunk(index: int, text: str, finished: bool = False) -> pb.TokenChunk:
    return pb.TokenChunk(
        index=index,
        token_ids=[ord(c) for c in text],
        text=text,
        finished=finished,
        finish_reason="stop" if finished else "",
        worker_id=WORKER,
    )


async def test_request_goes_through_router_and_queue_and_comes_back_in_order(backend, bus):
    seen: list[pb.RouteRequest] = []
    await serve_router(bus, PLACED, seen)
    params = pb.SamplingParams(max_tokens=5, temperature=0.0)
    stream = await backend.submit("r1", "m", list(range(40)), params)
    job = await take_job(bus)
    assert job.request_id == "r1" and list(job.prompt_token_ids) == list(range(40))
    assert job.params.max_tokens == 5 and job.decode_worker_id == WORKER
    assert job.gateway_id == backend.settings.instance_id  # workers publish tokens under it
    assert seen[0].num_prompt_tokens == 40 and len(seen[0].block_hashes) == 2
    # out of order, with a duplicate (a redelivered job's first token)
    for c in (chunk(0, "ab"), chunk(3, "d", finished=True), chunk(0, "ab"), chunk(2, "c")):
        await bus.publish(subjects.tokens(backend.settings.instance_id, "r1", WORKER), c)
    got = [c async for c in stream]
    await stream.close()
    assert "".join(c.text for c in got) == "abcd" and got[-1].finished


async def test_a_given_placement_skips_the_router(backend, bus):
    """The other choices of an `n` > 1 request go to the first choice's workers."""
    seen: list[pb.RouteRequest] = []
    await serve_router(bus, PLACED, seen)
    params = pb.SamplingParams(max_tokens=1)
    first = await backend.submit("n1", "m", list(range(40)), params)
    other = await backend.submit("n1-1", "m", list(range(40)), params, first.placement)
    jobs = [await take_job(bus), await take_job(bus)]
    assert [j.request_id for j in jobs] == ["n1", "n1-1"]
    assert [r.request_id for r in seen] == ["n1"]  # only the first was routed
    assert other.placement == first.placement and jobs[1].decode_worker_id == WORKER
    await first.close()
    await other.close()


async def test_cancel_reaches_the_workers(backend, bus):
    cancels: asyncio.Queue[tuple[str, pb.Cancel]] = asyncio.Queue()

    async def on_cancel(c: pb.Cancel, msg) -> None:
        cancels.put_nowait((msg.subject, c))

    await bus.subscribe(subjects.CANCEL_ALL, pb.Cancel, on_cancel)
    await bus.sync()
    await backend.cancel("r9", "client disconnected")
    subject, got = await asyncio.wait_for(cancels.get(), 2)
    assert got.request_id == "r9"
    assert subject == subjects.cancel(backend.settings.instance_id, "r9")


async def test_no_router_is_503_at_once(backend):
    t0 = time.monotonic()
    with pytest.raises(ApiError) as info:
        await backend.submit("r2", "m", [1, 2, 3], pb.SamplingParams(max_tokens=1))
    assert info.value.status == 503 and info.value.retry_after_s
    assert time.monotonic() - t0 < 1.0


async def test_router_errors_map_to_statuses(backend, bus):
    reply = pb.RouteReply(
        error=pb.RouteError(
            code=pb.RouteError.NO_WORKERS, message="no decode worker", retry_after_s=3
        )
    )
    sub = await serve_router(bus, reply, [])
    with pytest.raises(ApiError) as info:
        await backend.submit("r3", "m", [1], pb.SamplingParams(max_tokens=1))
    assert (info.value.status, info.value.retry_after_s, info.value.message) == (
        503,
        3,
        "no decode worker",
    )
    await sub.unsubscribe()


async def test_worker_error_chunk_is_an_openai_error(backend, bus):
    await serve_router(bus, PLACED, [])
    stream = await backend.submit("r4", "m", [1], pb.SamplingParams(max_tokens=1))
    await take_job(bus)
    error = pb.TokenChunk(
        index=0,
        finished=True,
        finish_reason="error",
        error=pb.Error(code=pb.Error.INVALID_REQUEST, message="bad params"),
    )
    await bus.publish(subjects.tokens(backend.settings.instance_id, "r4", WORKER), error)
    with pytest.raises(ApiError) as info:
        await anext(stream)
    assert info.value.status == 400 and info.value.message == "bad params"
    await stream.close()


async def test_a_dead_worker_fails_the_request_instead_of_hanging(backend, bus):
    await serve_router(bus, PLACED, [])
    await bus.publish(
        subjects.heartbeat("both", WORKER),
        pb.WorkerHeartbeat(worker_id=WORKER, role="both", heartbeat_interval_ms=100),
    )
    stream = await backend.submit("r5", "m", [1], pb.SamplingParams(max_tokens=5))
    await take_job(bus)
    await bus.publish(subjects.tokens(backend.settings.instance_id, "r5", WORKER), chunk(0, "a"))
    assert (await anext(stream)).text == "a"
    t0 = time.monotonic()
    with pytest.raises(ApiError) as info:  # no more heartbeats, no more chunks
        await anext(stream)
    assert info.value.status == 503 and info.value.code == "worker_lost"
    assert time.monotonic() - t0 < 3
    await stream.close()


async def test_a_request_past_its_deadline_ends_with_504_while_tokens_still_flow(nats_url, bus):
    settings = GatewaySettings(nats_url=nats_url, route_timeout_s=1, request_timeout_s=1.0)
    backend = NatsBackend(settings)
    await backend.start()
    try:
        await serve_router(bus, PLACED, [])
        stream = await backend.submit("r-late", "m", [1, 2, 3], pb.SamplingParams(max_tokens=99))
        await take_job(bus)
        with pytest.raises(ApiError) as info:
            for i in range(100):  # a worker that keeps sending, slowly, never finishing
                await bus.publish(
                    subjects.tokens(backend.settings.instance_id, "r-late", WORKER), chunk(i, "x")
                )
                await anext(stream)
                await asyncio.sleep(0.05)
        assert info.value.status == 504 and "deadline" in info.value.message
        await stream.close()
    finally:
        await backend.stop()


async def test_a_job_waiting_for_its_restarted_prefill_worker_is_not_given_up(nats_url, bus):
    """Before the first token the job is safe in the work queue: a dead prefill worker that
    comes back (restarted) still answers it, past dead_worker_grace_s."""
    settings = GatewaySettings(
        nats_url=nats_url, dead_worker_grace_s=0.5, prefill_redelivery_grace_s=30
    )
    backend = NatsBackend(settings)
    await backend.start()
    beat = pb.WorkerHeartbeat(worker_id=WORKER, role="both", heartbeat_interval_ms=100)
    try:
        await serve_router(bus, PLACED, [])
        await bus.publish(subjects.heartbeat("both", WORKER), beat)
        stream = await backend.submit("r-back", "m", [1], pb.SamplingParams(max_tokens=2))
        await take_job(bus)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(2.0)  # the worker is dead (no heartbeats) for 4x the grace
        assert not first.done()
        await bus.publish(subjects.heartbeat("both", WORKER), beat)  # back after a restart
        await bus.publish(
            subjects.tokens(backend.settings.instance_id, "r-back", WORKER), chunk(0, "a")
        )
        await bus.publish(
            subjects.tokens(backend.settings.instance_id, "r-back", WORKER),
            chunk(1, "b", finished=True),
        )
        assert (await asyncio.wait_for(first, 5)).text == "a"
        assert [c.text async for c in stream] == ["b"]
        await stream.close()
    finally:
        await backend.stop()


async def test_a_stream_whose_only_worker_died_is_resumed_on_it_once_restarted(nats_url, bus):
    """One worker: it dies mid-stream, nobody can resume the request, so the gateway holds
    the stream (no error) until the worker is back, then resumes it there from the tokens
    streamed so far, though the worker has the same id: its heartbeat's epoch is new."""
    settings = GatewaySettings(
        nats_url=nats_url, dead_worker_grace_s=0.5, prefill_redelivery_grace_s=30
    )
    backend = NatsBackend(settings)
    await backend.start()
    resumes: list[pb.DecodeHandoff] = []

    async def on_resume(handoff: pb.DecodeHandoff, msg) -> None:
        resumes.append(handoff)
        await bus.reply(msg, pb.HandoffAck(request_id=handoff.request_id, accepted=True))

    def beat(epoch: str) -> pb.WorkerHeartbeat:
        return pb.WorkerHeartbeat(
            worker_id=WORKER, role="both", heartbeat_interval_ms=100, kv_epoch=epoch
        )

    tokens = subjects.tokens(settings.instance_id, "r-hold", WORKER)
    try:
        await serve_router(bus, PLACED, [])
        await bus.subscribe(subjects.decode_jobs(WORKER), pb.DecodeHandoff, on_resume)
        await bus.publish(subjects.heartbeat("both", WORKER), beat("first"))
        stream = await backend.submit("r-hold", "m", [1], pb.SamplingParams(max_tokens=3))
        await take_job(bus)
        await bus.publish(tokens, chunk(0, "a"))
        assert (await anext(stream)).text == "a"
        second = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(2.5)  # dead for 5x dead_worker_grace_s: held, not failed
        assert not second.done() and resumes == []
        await bus.publish(subjects.heartbeat("both", WORKER), beat("second"))
        for _ in range(40):
            if resumes:
                break
            await asyncio.sleep(0.1)
        (resume,) = resumes
        assert list(resume.output_token_ids) == [ord("a")] and resume.request_id == "r-hold"
        await bus.publish(tokens, chunk(1, "b"))
        await bus.publish(tokens, chunk(2, "c", finished=True))
        assert (await asyncio.wait_for(second, 5)).text == "b"
        assert [c.text async for c in stream] == ["c"]
        await stream.close()
    finally:
        await backend.stop()


async def test_a_queued_request_waits_for_its_restarted_worker_past_the_grace(nats_url, bus):
    """One worker: a request waits in its queue longer than the grace, then the worker dies
    and restarts (a new epoch) before its first token. The job waits for the restarted
    worker in its work queue, so the request waits too: the grace counts from the loss, and
    the restart is adopted, instead of the request being refused as worker_lost."""
    settings = GatewaySettings(
        nats_url=nats_url, dead_worker_grace_s=0.5, prefill_redelivery_grace_s=3.0
    )
    backend = NatsBackend(settings)
    await backend.start()

    def beat(epoch: str) -> pb.WorkerHeartbeat:
        return pb.WorkerHeartbeat(
            worker_id=WORKER, role="both", heartbeat_interval_ms=100, kv_epoch=epoch
        )

    async def beat_for(seconds: float, epoch: str) -> None:
        for _ in range(int(seconds / 0.1)):
            await bus.publish(subjects.heartbeat("both", WORKER), beat(epoch))
            await asyncio.sleep(0.1)

    tokens = subjects.tokens(settings.instance_id, "r-queued", WORKER)
    try:
        await serve_router(bus, PLACED, [])
        await bus.publish(subjects.heartbeat("both", WORKER), beat("first"))
        stream = await backend.submit("r-queued", "m", [1], pb.SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(anext(stream))
        await beat_for(3.5, "first")  # queued behind others, past the grace
        await asyncio.sleep(1.0)  # killed: dead for twice dead_worker_grace_s
        await beat_for(1.5, "second")  # restarted, loading, then running its queue
        assert not first.done(), first.exception() if first.done() else None
        await bus.publish(tokens, chunk(0, "a"))
        await bus.publish(tokens, chunk(1, "b", finished=True))
        assert (await asyncio.wait_for(first, 5)).text == "a"
        assert [c.text async for c in stream] == ["b"]
        await stream.close()
    finally:
        await backend.stop()
