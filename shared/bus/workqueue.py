"""A JetStream work queue as its consumers see it: jobs in, outcomes out.

Each worker pulls from a durable consumer of its own, ``<prefix><worker id>``, filtered on its
own subject, so a publisher pins a job to a worker. The queue owns the JetStream mechanics
and a handler keeps only the job's meaning:

    job arrives ------> handler.run(delivery) --> DONE       --> ack   (gone for good)
      |                        |              --> HAND_BACK  --> nak   (redelivered)
      |  in_progress() every   +-- raises ---> nak, or on the last delivery:
      |  ack_wait / 3 while it runs              term + handler.give_up(delivery, error)
      +-- undecodable: term

A worker pulls from its own consumer only (its NATS user may touch no other:
tokenyard.bus.auth). One that dies leaves its unacked jobs in its consumer, and the router
places them again on live workers (tokenyard.bus.orphans).

A consumer of ours that goes missing (deleted by hand, its inactivity threshold, a NATS
restart without its store) is noticed by a scan and made again; until then
:meth:`WorkQueue.problem` says why no job can reach us (the worker's /ready and heartbeat).
The stream is its owner's (the gateway's) to make: a worker waits for it.

    queue = WorkQueue(bus, spec, worker_id, pb.PrefillJob, handler, stopping=...)
    await queue.start(tg)
    ...
    await queue.remove_own_consumer_if_empty()  # on a clean stop
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import Message
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BadRequestError, NotFoundError
from opentelemetry import context

from tokenyard.bus.nats import Bus, BusError, parse
from tokenyard.bus.orphans import MOVES_HEADER
from tokenyard.tracing import extract_context

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
STREAM_NOT_FOUND = 10059  # JetStream's error code (a missing consumer is 10014)


class Outcome(enum.Enum):
    DONE = "done"  # ack: the job is finished (or will be, without the queue's help)
    HAND_BACK = "hand_back"  # nak: redeliver it, to a live worker once this one is gone


@dataclass(frozen=True)
class Delivery(Generic[M]):
    job: M
    attempt: int  # 1 on the first delivery
    max_attempts: int
    moved: int  # times the router placed it again, its worker gone (tokenyard.bus.orphans)

    @property
    def last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts


class JobHandler(Protocol[M]):
    async def run(self, delivery: Delivery[M]) -> Outcome:
        """Do the job; raising means "failed, retry it" (up to max_deliver deliveries)."""
        ...

    async def give_up(self, delivery: Delivery[M], error: Exception) -> None:
        """The last delivery failed too: the job is dropped, tell whoever waits for it."""
        ...


@dataclass(frozen=True)
class WorkQueueSpec:
    stream: str
    subjects: list[str]  # the stream's subjects
    consumer_prefix: str  # a worker's consumer is named consumer_prefix + worker id
    subject_for: Callable[[str], str]  # worker id -> the subject its jobs are published on
    ack_wait_s: float
    max_deliver: int
    max_in_flight: int  # jobs running at once
    fetch_timeout_s: float = 1.0
    scan_interval_s: float = 1.0
    # A consumer nobody pulls from (its worker gone, its jobs not moved) goes away by itself
    # instead of piling up on a long-lived NATS.
    consumer_inactive_s: float = 3600.0
    replicas: int = 1  # copies of the stream on a NATS cluster (3 on a 3-node cluster)

    def consumer_name(self, worker_id: str) -> str:
        return f"{self.consumer_prefix}{worker_id}"

    def consumer_config(self, worker_id: str) -> ConsumerConfig:
        # NOTE: `name` too: nats-py then asks for the consumer on
        # $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>, the subject a worker's NATS user
        # may publish on for its own name and filter only (tokenyard.bus.auth).
        return ConsumerConfig(
            name=self.consumer_name(worker_id),
            durable_name=self.consumer_name(worker_id),
            filter_subject=self.subject_for(worker_id),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=self.max_deliver,
            inactive_threshold=self.consumer_inactive_s,
        )


class WorkQueue(Generic[M]):
    def __init__(
        self,
        bus: Bus,
        spec: WorkQueueSpec,
        worker_id: str,
        message_type: type[M],
        handler: JobHandler[M],
        *,
        stopping: asyncio.Event,
        accepting: asyncio.Event | None = None,
    ) -> None:
        self.bus = bus
        self.spec = spec
        self.worker_id = worker_id
        self.message_type = message_type
        self.handler = handler
        self.stopping = stopping
        # Cleared: fetch nothing new (a drained worker); jobs already taken run on.
        self.accepting = accepting
        self._slots = asyncio.Semaphore(spec.max_in_flight)
        self._tg: asyncio.TaskGroup | None = None
        self._problem: str | None = None  # why our consumer cannot deliver now
        self._stream_gone = False  # the last check found no stream (its owner makes it)
        self._consuming: asyncio.Task[None] | None = None

    async def start(self, tg: asyncio.TaskGroup) -> None:
        """Create our consumer (or reuse it), then consume from it.

        The stream is its owner's to make (the gateway's, tokenyard.bus.auth): while it is
        missing, :meth:`problem` says so and the scan makes our consumer once it is there."""
        self._tg = tg
        name = self.spec.consumer_name(self.worker_id)
        try:
            await self._add_own_consumer()
        except NotFoundError:
            self._stream_gone, self._problem = True, self._stream_missing()
            log.warning("%s; waiting for it", self._problem)
        psub = await self.bus.js.pull_subscribe_bind(name, self.spec.stream)
        self._consuming = tg.create_task(self._consume(psub), name=f"{name} consume")
        tg.create_task(self._scan(), name=f"{name} scan")

    async def _add_own_consumer(self) -> str:
        config = self.spec.consumer_config(self.worker_id)
        try:
            await self.bus.js.add_consumer(self.spec.stream, config)
        except BadRequestError as exc:  # ours from an earlier run, with other settings: reuse it
            log.info("reusing consumer %s (%s)", config.durable_name, exc.description)
        assert config.durable_name is not None
        return config.durable_name

    def _stream_missing(self) -> str:
        return f"the JetStream stream {self.spec.stream} is missing (its owner makes it)"

    def problem(self) -> str | None:
        """Why jobs cannot reach us now, as the last check found (None: they can)."""
        return self._problem

    async def check(self, timeout: float = 2.0) -> str | None:
        """Ask JetStream now whether our consumer exists (the worker's /ready)."""
        name = self.spec.consumer_name(self.worker_id)
        try:
            await asyncio.wait_for(self.bus.js.consumer_info(self.spec.stream, name), timeout)
        except NotFoundError as exc:
            self._stream_gone = exc.err_code == STREAM_NOT_FOUND
            self._problem = (
                self._stream_missing()
                if self._stream_gone
                else f"its JetStream consumer {name} is missing"
            )
        except Exception as exc:  # timeout, no JetStream, connection trouble
            # NOTE: not kept for the heartbeats: a slow answer under load is no proof that
            # jobs cannot reach us, and the router would stop placing here for it.
            return f"JetStream does not answer ({type(exc).__name__})"
        else:
            self._stream_gone, self._problem = False, None
        return self._problem

    async def stop_fetching(self) -> None:
        """Fetch nothing more, now (with ``stopping`` set): a job handed back after this
        stays in our consumer for the router to place again, not fetched back by a pull
        still open here. A job a cancelled pull took anyway is redelivered after ack_wait."""
        task = self._consuming
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def remove_own_consumer_if_empty(self) -> None:
        """On a clean stop: delete our consumer unless jobs still wait in it."""
        name = self.spec.consumer_name(self.worker_id)
        with contextlib.suppress(Exception):
            info = await self.bus.js.consumer_info(self.spec.stream, name)
            if not (info.num_pending or info.num_ack_pending):
                await self.bus.js.delete_consumer(self.spec.stream, name)

    # --- consuming -----------------------------------------------------------------------

    async def _consume(self, psub: Any) -> None:
        """Fetch one job per free slot."""
        try:
            while await self._open():
                await self._slots.acquire()
                if self.stopping.is_set():  # it waited for a slot while we began to stop
                    self._slots.release()
                    return
                try:
                    msgs = await psub.fetch(1, timeout=self.spec.fetch_timeout_s)
                except (NatsTimeoutError, TimeoutError):
                    self._slots.release()
                    continue
                except Exception:
                    self._slots.release()
                    if self.stopping.is_set():
                        return
                    log.exception("fetching from %s failed", self.spec.stream)
                    await asyncio.sleep(self.spec.fetch_timeout_s)
                    continue
                assert self._tg is not None
                for msg in msgs:
                    self._tg.create_task(self._run(msg))
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def _open(self) -> bool:
        """Wait while fetching is paused; False once the queue is stopping."""
        while self.accepting is not None and not self.accepting.is_set():
            if self.stopping.is_set():
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.accepting.wait(), self.spec.fetch_timeout_s)
        return not self.stopping.is_set()

    async def _run(self, msg: Msg) -> None:
        try:
            job = parse(self.message_type, msg.data)
        except BusError:
            log.warning("dropping an undecodable %s", self.message_type.__name__)
            await msg.term()
            self._slots.release()
            return
        moved = int((msg.headers or {}).get(MOVES_HEADER, "0"))
        delivery = Delivery(job, msg.metadata.num_delivered or 1, self.spec.max_deliver, moved)
        # The job runs in the trace its publisher put in the headers, as Bus.subscribe does.
        token = context.attach(extract_context(msg.headers))
        try:
            async with self._in_progress(msg):
                outcome = await self.handler.run(delivery)
            await (msg.ack() if outcome is Outcome.DONE else msg.nak())
        except Exception as exc:
            log.exception(
                "a job on %s failed (delivery %d of %d)",
                msg.subject,
                delivery.attempt,
                delivery.max_attempts,
            )
            await self._failed(delivery, msg, exc)
        finally:
            context.detach(token)
            self._slots.release()

    async def _failed(self, delivery: Delivery[M], msg: Msg, exc: Exception) -> None:
        """Retry on another delivery; on the last one, let the handler say so instead."""
        with contextlib.suppress(Exception):
            if not delivery.last_attempt:
                await msg.nak()
                return
            await msg.term()
            await self.handler.give_up(delivery, exc)

    @contextlib.asynccontextmanager
    async def _in_progress(self, msg: Msg) -> AsyncIterator[None]:
        """Keep JetStream from redelivering a job while it is still being worked on."""

        async def tick() -> None:
            while True:
                await asyncio.sleep(self.spec.ack_wait_s / 3)
                with contextlib.suppress(Exception):
                    await msg.in_progress()

        task = asyncio.create_task(tick())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- keeping our consumer -------------------------------------------------------------

    async def _scan(self) -> None:
        """Each scan_interval_s: make our consumer again if it is gone."""
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.spec.scan_interval_s)
                return
            await self._keep_own_consumer()

    async def _keep_own_consumer(self) -> None:
        await self.check()
        if self._problem is None or self._stream_gone or self.stopping.is_set():
            return  # there, or JetStream did not say it is not, or no stream to make it in
        name = self.spec.consumer_name(self.worker_id)
        log.warning("consumer %s is gone; making it again", name)
        try:
            await self._add_own_consumer()
        except Exception:
            log.exception("making consumer %s again failed", name)
            return
        # Our pull subscription asks for jobs by the consumer's name: it goes on as before.
        self._problem = None
