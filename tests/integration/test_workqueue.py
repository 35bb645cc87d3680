"""The JetStream work queue against a real nats-server: acks, hand-backs, retries and giving
up, undecodable jobs, in-progress ticks, the in-flight cap, and moving a departed worker's
jobs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.js.errors import NotFoundError

from tokenyard.bus.nats import Bus
from tokenyard.bus.orphans import OrphanedJobs
from tokenyard.bus.workqueue import Delivery, Outcome, WorkQueue, WorkQueueSpec
from tokenyard.v1 import serving_pb2 as pb

_names = itertools.count()


def make_spec(**overrides) -> WorkQueueSpec:
    """A queue on a stream of its own (the nats-server is shared by the module's tests)."""
    n = next(_names)
    fields = {
        "stream": f"TESTQ{n}",
        "subjects": [f"testq{n}.>"],
        "consumer_prefix": "w-",
        "subject_for": lambda worker_id, n=n: f"testq{n}.{worker_id}",
        "ack_wait_s": 2.0,
        "max_deliver": 3,
        "max_in_flight": 4,
        "fetch_timeout_s": 0.2,
        "scan_interval_s": 0.2,
    }
    fields.update(overrides)
    return WorkQueueSpec(**fields)


class Recorder:
    """A handler whose behaviour per job is scripted by ``act(delivery)``."""

    def __init__(self, act: Callable[[Delivery[pb.PrefillJob]], Awaitable[Outcome]]) -> None:
        self.act = act
        self.deliveries: list[Delivery[pb.PrefillJob]] = []
        self.gave_up: list[tuple[Delivery[pb.PrefillJob], Exception]] = []
        self.running = 0
        self.max_running = 0

    async def run(self, delivery: Delivery[pb.PrefillJob]) -> Outcome:
        self.deliveries.append(delivery)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            return await self.act(delivery)
        finally:
            self.running -= 1

    async def give_up(self, delivery: Delivery[pb.PrefillJob], error: Exception) -> None:
        self.gave_up.append((delivery, error))

    def attempts(self, rid: str) -> list[int]:
        return [d.attempt for d in self.deliveries if d.job.request_id == rid]


async def done(_d: Delivery[pb.PrefillJob]) -> Outcome:
    return Outcome.DONE


async def until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the queue"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running(
    bus: Bus,
    spec: WorkQueueSpec,
    handler: Recorder,
    worker_id: str = "me",
) -> AsyncIterator[WorkQueue[pb.PrefillJob]]:
    await bus.ensure_work_queue(spec.stream, spec.subjects)  # as its owner, the gateway, does
    stopping = asyncio.Event()
    queue = WorkQueue(bus, spec, worker_id, pb.PrefillJob, handler, stopping=stopping)
    async with asyncio.TaskGroup() as tg:
        await queue.start(tg)
        try:
            yield queue
        finally:
            stopping.set()


async def publish(bus: Bus, spec: WorkQueueSpec, worker_id: str, *rids: str) -> None:
    for rid in rids:
        await bus.js_publish(spec.subject_for(worker_id), pb.PrefillJob(request_id=rid))


async def consumer_counts(bus: Bus, spec: WorkQueueSpec, worker_id: str) -> tuple[int, int]:
    info = await bus.js.consumer_info(spec.stream, spec.consumer_name(worker_id))
    return info.num_pending or 0, info.num_ack_pending or 0


async def test_done_jobs_are_acked_once(bus):
    spec = make_spec()
    handler = Recorder(done)
    async with running(bus, spec, handler):
        await publish(bus, spec, "me", "a", "b", "c")
        await until(lambda: len(handler.deliveries) == 3)
        await until_settled(bus, spec, "me")
    assert sorted(d.job.request_id for d in handler.deliveries) == ["a", "b", "c"]
    assert all(d.attempt == 1 and not d.moved for d in handler.deliveries)
    assert (await bus.js.stream_info(spec.stream)).state.messages == 0  # acked = removed


async def until_settled(bus: Bus, spec: WorkQueueSpec, worker_id: str) -> None:
    for _ in range(200):
        if await consumer_counts(bus, spec, worker_id) == (0, 0):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"jobs still pending: {await consumer_counts(bus, spec, worker_id)}")


async def test_a_handed_back_job_is_delivered_again(bus):
    spec = make_spec()

    async def back_once(d: Delivery[pb.PrefillJob]) -> Outcome:
        return Outcome.HAND_BACK if d.attempt == 1 else Outcome.DONE

    handler = Recorder(back_once)
    async with running(bus, spec, handler):
        await publish(bus, spec, "me", "j")
        await until(lambda: len(handler.deliveries) == 2)
        await until_settled(bus, spec, "me")
    assert handler.attempts("j") == [1, 2]
    assert handler.gave_up == []


async def test_a_failing_job_is_retried_then_given_up(bus):
    spec = make_spec(max_deliver=3)

    async def fail(_d: Delivery[pb.PrefillJob]) -> Outcome:
        raise RuntimeError("boom")

    handler = Recorder(fail)
    async with running(bus, spec, handler):
        await publish(bus, spec, "me", "bad")
        await until(lambda: len(handler.gave_up) == 1)
        await until_settled(bus, spec, "me")
    assert handler.attempts("bad") == [1, 2, 3]
    ((last, error),) = handler.gave_up
    assert last.attempt == 3 and last.last_attempt and str(error) == "boom"


async def test_an_undecodable_job_is_dropped_and_the_next_runs(bus):
    spec = make_spec()
    handler = Recorder(done)
    async with running(bus, spec, handler):
        await bus.js.publish(spec.subject_for("me"), b"\xff\xff\xff")
        await publish(bus, spec, "me", "good")
        await until(lambda: len(handler.deliveries) == 1)
        await until_settled(bus, spec, "me")
    assert [d.job.request_id for d in handler.deliveries] == ["good"]


async def test_a_job_longer_than_ack_wait_is_not_redelivered(bus):
    spec = make_spec(ack_wait_s=1.0)

    async def slow(_d: Delivery[pb.PrefillJob]) -> Outcome:
        await asyncio.sleep(3.0)  # three ack_waits: only the in-progress ticks keep it ours
        return Outcome.DONE

    handler = Recorder(slow)
    async with running(bus, spec, handler):
        await publish(bus, spec, "me", "long")
        await until(lambda: len(handler.deliveries) == 1)
        await until_settled(bus, spec, "me")
    assert handler.attempts("long") == [1]


async def test_no_more_jobs_run_at_once_than_max_in_flight(bus):
    spec = make_spec(max_in_flight=2)

    async def slow(_d: Delivery[pb.PrefillJob]) -> Outcome:
        await asyncio.sleep(0.3)
        return Outcome.DONE

    handler = Recorder(slow)
    async with running(bus, spec, handler):
        await publish(bus, spec, "me", *[f"j{i}" for i in range(6)])
        await until(lambda: len(handler.deliveries) == 6)
        await until_settled(bus, spec, "me")
    assert handler.max_running == 2


async def test_a_departed_workers_jobs_are_moved_to_a_live_one_and_its_consumer_removed(bus):
    spec = make_spec(ack_wait_s=1.0)
    await bus.ensure_work_queue(spec.stream, spec.subjects)
    for worker_id in ("gone", "peer"):
        await bus.js.add_consumer(spec.stream, spec.consumer_config(worker_id))
    await publish(bus, spec, "gone", "g1", "g2")
    await publish(bus, spec, "peer", "p1")
    # "gone" took g1 and died before acking it: it comes back once its ack_wait runs out.
    taken = await bus.js.pull_subscribe_bind(spec.consumer_name("gone"), spec.stream)
    assert len(await taken.fetch(1, timeout=2)) == 1
    placed: list[tuple[str, str]] = []

    def place(job: pb.PrefillJob, gone: str) -> tuple[str, pb.PrefillJob]:
        placed.append((job.request_id, gone))
        return "me", job

    stopping = asyncio.Event()
    orphans = OrphanedJobs(
        bus,
        spec.stream,
        spec.consumer_prefix,
        spec.subject_for,
        pb.PrefillJob,
        place=place,
        alive=lambda w: w != "gone",
        stopping=stopping,
        grace_s=0.0,
        scan_interval_s=0.2,
        fetch_timeout_s=0.2,
    )
    handler = Recorder(done)
    async with running(bus, spec, handler), asyncio.TaskGroup() as tg:
        tg.create_task(orphans.run())
        await until(lambda: len(handler.deliveries) == 2)
        assert all(d.moved == 1 and d.attempt == 1 for d in handler.deliveries)
        # Once idle for two ack_waits it lets go and deletes the empty consumer.
        await until(lambda: not orphans.moving and len(placed) == 2)
        stopping.set()
    assert sorted(d.job.request_id for d in handler.deliveries) == ["g1", "g2"]
    assert sorted(placed) == [("g1", "gone"), ("g2", "gone")]
    with pytest.raises(NotFoundError):
        await bus.js.consumer_info(spec.stream, spec.consumer_name("gone"))
    assert await consumer_counts(bus, spec, "peer") == (1, 0)  # a live peer's job stays its own


async def test_a_job_nobody_can_take_is_held_for_its_restarted_worker(bus):
    """The only worker dies with a job waiting: while nobody can take it the router holds it
    (no delivery spent each scan), and the worker restarted under the same id runs it."""
    spec = make_spec(ack_wait_s=1.0, max_deliver=3)
    await bus.ensure_work_queue(spec.stream, spec.subjects)
    await bus.js.add_consumer(spec.stream, spec.consumer_config("me"))
    await publish(bus, spec, "me", "queued")
    back = asyncio.Event()
    asked: list[str] = []

    def place(job: pb.PrefillJob, gone: str) -> None:
        asked.append(job.request_id)  # no live worker: nowhere to put it
        return None

    stopping = asyncio.Event()
    orphans = OrphanedJobs(
        bus,
        spec.stream,
        spec.consumer_prefix,
        spec.subject_for,
        pb.PrefillJob,
        place=place,
        alive=lambda w: back.is_set(),
        stopping=stopping,
        grace_s=0.0,
        scan_interval_s=0.2,
        fetch_timeout_s=0.2,
    )
    handler = Recorder(done)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(orphans.run())
        # Ten scans without a taker: more than max_deliver deliveries, were each a nak.
        await until(lambda: len(asked) >= 10)
        back.set()  # the worker is back under its id
        async with running(bus, spec, handler):
            await until(lambda: len(handler.deliveries) == 1)
            await until_settled(bus, spec, "me")
        stopping.set()
    (delivery,) = handler.deliveries
    assert delivery.job.request_id == "queued" and delivery.attempt <= spec.max_deliver


async def test_a_clean_stop_removes_an_empty_consumer_only(bus):
    spec = make_spec()
    handler = Recorder(done)
    async with running(bus, spec, handler) as queue:
        pass
    await publish(bus, spec, "me", "later")
    await queue.remove_own_consumer_if_empty()
    assert await consumer_counts(bus, spec, "me") == (1, 0)  # a job waits: it stays
    async with running(bus, spec, handler) as queue:
        await until(lambda: len(handler.deliveries) == 1)
        await until_settled(bus, spec, "me")
    await queue.remove_own_consumer_if_empty()
    with pytest.raises(NotFoundError):
        await bus.js.consumer_info(spec.stream, spec.consumer_name("me"))


async def test_a_deleted_consumer_is_reported_and_made_again(bus):
    spec = make_spec(scan_interval_s=0.5)
    handler = Recorder(done)
    async with running(bus, spec, handler) as queue:
        assert await queue.check() is None and queue.problem() is None
        await bus.js.delete_consumer(spec.stream, spec.consumer_name("me"))
        said = await queue.check()
        assert said == "its JetStream consumer w-me is missing" and queue.problem() == said
        await until(lambda: queue.problem() is None)  # the scan made it again
        assert await queue.check() is None
        # The same pull subscription takes jobs from the new consumer.
        await publish(bus, spec, "me", "after")
        await until(lambda: handler.attempts("after") == [1])


async def test_a_queue_waits_for_its_stream_and_makes_its_consumer_once_the_owner_does(bus):
    spec = make_spec(scan_interval_s=0.2)
    handler = Recorder(done)
    stopping = asyncio.Event()
    queue = WorkQueue(bus, spec, "me", pb.PrefillJob, handler, stopping=stopping)
    async with asyncio.TaskGroup() as tg:
        await queue.start(tg)  # no stream yet: a worker may not make it
        try:
            assert (
                queue.problem()
                == f"the JetStream stream {spec.stream} is missing (its owner makes it)"
            )
            await bus.ensure_work_queue(spec.stream, spec.subjects)
            await until(lambda: queue.problem() is None)
            await publish(bus, spec, "me", "first")
            await until(lambda: handler.attempts("first") == [1])
        finally:
            stopping.set()


async def test_a_stopping_queue_fetches_nothing_back_that_it_hands_back(bus):
    """A stopping worker hands back its queued jobs at once (tokenyard.services.worker.main's
    shutdown): after `stop_fetching` no pull of its own takes them again, so they stay in its
    consumer for the router to place elsewhere, and no redelivery to it uses up max_deliver."""
    spec = make_spec(max_in_flight=1)
    release = asyncio.Event()

    async def wait_then_hand_back(_d: Delivery[pb.PrefillJob]) -> Outcome:
        await release.wait()
        return Outcome.HAND_BACK

    handler = Recorder(wait_then_hand_back)
    await bus.ensure_work_queue(spec.stream, spec.subjects)
    stopping = asyncio.Event()
    queue = WorkQueue(bus, spec, "me", pb.PrefillJob, handler, stopping=stopping)
    async with asyncio.TaskGroup() as tg:
        await queue.start(tg)
        await publish(bus, spec, "me", "a", "b")
        await until(lambda: len(handler.deliveries) == 1)  # one slot: "b" waits in the consumer
        stopping.set()
        await queue.stop_fetching()
        release.set()  # the running job is handed back (nak'd) after fetching stopped
        await until(lambda: handler.running == 0)
        await asyncio.sleep(4 * spec.fetch_timeout_s)  # a pull still open would take it now
    assert [d.job.request_id for d in handler.deliveries] == ["a"]
    pending, ack_pending = await consumer_counts(bus, spec, "me")
    assert pending + ack_pending == 2  # both wait in the consumer, for the router to move
