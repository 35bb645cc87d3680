"""A JetStream work queue as its consumers see it: jobs in, outcomes out.

Each worker pulls from a durable consumer of its own, ``<prefix><worker id>``, filtered on its
own subject, so a publisher pins a job to a worker. The queue owns the JetStream mechanics
and a handler keeps only the job's meaning:

    job arrives ------> handler.run(delivery) --> DONE       --> ack   (gone for good)
      |                        |              --> HAND_BACK  --> nak   (redelivered)
      |  in_progress() every   +-- raises ---> nak, or on the last delivery:
      |  ack_wait / 3 while it runs              term + handler.give_up(delivery, error)
      +-- undecodable: term

A worker that dies leaves its unacked jobs in its consumer. Live workers notice it is gone
(``alive(worker_id)`` turns false: no heartbeats) and pull from that consumer too, so the jobs
are redelivered to them once ack_wait runs out; the consumer is deleted once it is empty.

A consumer of ours that goes missing (deleted by hand, its inactivity threshold, a NATS
restart without its store) is noticed by the same scan and made again; until then
:meth:`WorkQueue.problem` says why no job can reach us (the worker's /ready and heartbeat).

    queue = WorkQueue(bus, spec, worker_id, pb.PrefillJob, handler, alive=..., stopping=...)
    await queue.start(tg)
    ...
    await queue.remove_own_consumer_if_empty()  # on a clean stop
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import Message
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo
from nats.js.errors import BadRequestError, NotFoundError
from opentelemetry import context

from tokenyard.bus.nats import Bus, BusError, parse
from tokenyard.tracing import extract_context

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class Outcome(enum.Enum):
    DONE = "done"  # ack: the job is finished (or will be, without the queue's help)
    HAND_BACK = "hand_back"  # nak: redeliver it, to a live worker once this one is gone


@dataclass(frozen=True)
class Delivery(Generic[M]):
    job: M
    attempt: int  # 1 on the first delivery
    max_attempts: int
    adopted: bool  # pulled from the consumer of a worker that is gone

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
    max_in_flight: int  # jobs running at once, over our consumer and adopted ones together
    adopt_after_s: float  # adopt nothing this soon after start: peers' heartbeats not heard yet
    fetch_timeout_s: float = 1.0
    scan_interval_s: float = 1.0
    # A consumer nobody pulls from (its worker gone, nobody adopted it) goes away by itself
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
        alive: Callable[[str], bool],
        stopping: asyncio.Event,
        accepting: asyncio.Event | None = None,
    ) -> None:
        self.bus = bus
        self.spec = spec
        self.worker_id = worker_id
        self.message_type = message_type
        self.handler = handler
        self.alive = alive
        self.stopping = stopping
        # Cleared: fetch nothing new (a drained worker); jobs already taken run on.
        self.accepting = accepting
        self.adopting: set[str] = set()  # worker ids whose consumers we pull from now
        self._slots = asyncio.Semaphore(spec.max_in_flight)
        self._tg: asyncio.TaskGroup | None = None
        self._started = time.monotonic()
        self._problem: str | None = None  # why our consumer cannot deliver now

    async def start(self, tg: asyncio.TaskGroup) -> None:
        """Create our consumer (or reuse it), then consume and adopt.

        The stream is its owner's to make (the gateway's, tokenyard.bus.auth): while it is
        missing, :meth:`problem` says so and the scan makes our consumer once it is there."""
        self._tg = tg
        self._started = time.monotonic()
        name = self.spec.consumer_name(self.worker_id)
        try:
            await self._add_own_consumer()
        except NotFoundError:
            self._problem = self._stream_missing()
            log.warning("%s; waiting for it", self._problem)
        psub = await self.bus.js.pull_subscribe_bind(name, self.spec.stream)
        tg.create_task(self._consume(psub, adopted=False), name=f"{name} consume")
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
        except NotFoundError:
            self._problem = f"its JetStream consumer {name} is missing"
        except Exception as exc:  # timeout, no JetStream, connection trouble
            # NOTE: not kept for the heartbeats: a slow answer under load is no proof that
            # jobs cannot reach us, and the router would stop placing here for it.
            return f"JetStream does not answer ({type(exc).__name__})"
        else:
            self._problem = None
        return self._problem

    async def remove_own_consumer_if_empty(self) -> None:
        """On a clean stop: delete our consumer unless jobs still wait in it."""
        name = self.spec.consumer_name(self.worker_id)
        with contextlib.suppress(Exception):
            info = await self.bus.js.consumer_info(self.spec.stream, name)
            if not (info.num_pending or info.num_ack_pending):
                await self.bus.js.delete_consumer(self.spec.stream, name)

    # --- consuming -----------------------------------------------------------------------

    async def _consume(
        self, psub: Any, *, adopted: bool, until_idle_s: float | None = None
    ) -> None:
        """Fetch one job per free slot; an adopted consumer is left once idle for a while."""
        idle_since = time.monotonic()
        try:
            while await self._open():
                await self._slots.acquire()
                try:
                    msgs = await psub.fetch(1, timeout=self.spec.fetch_timeout_s)
                except (NatsTimeoutError, TimeoutError):
                    self._slots.release()
                    if until_idle_s is not None and time.monotonic() - idle_since > until_idle_s:
                        return
                    continue
                except Exception:
                    self._slots.release()
                    if self.stopping.is_set():
                        return
                    log.exception("fetching from %s failed", self.spec.stream)
                    await asyncio.sleep(self.spec.fetch_timeout_s)
                    continue
                idle_since = time.monotonic()
                assert self._tg is not None
                for msg in msgs:
                    self._tg.create_task(self._run(msg, adopted=adopted))
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

    async def _run(self, msg: Msg, *, adopted: bool) -> None:
        try:
            job = parse(self.message_type, msg.data)
        except BusError:
            log.warning("dropping an undecodable %s", self.message_type.__name__)
            await msg.term()
            self._slots.release()
            return
        delivery = Delivery(job, msg.metadata.num_delivered or 1, self.spec.max_deliver, adopted)
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

    # --- departed workers' jobs ----------------------------------------------------------

    async def _scan(self) -> None:
        """Each scan_interval_s: make our consumer again if it is gone, and pull from the
        consumers of workers that are gone and left jobs behind."""
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.spec.scan_interval_s)
                return
            try:
                infos = await self.bus.js.consumers_info(self.spec.stream)
            except NotFoundError:
                self._problem = self._stream_missing()
                continue
            except Exception:
                log.debug("listing the consumers of %s failed", self.spec.stream, exc_info=True)
                continue
            await self._keep_own_consumer({info.name for info in infos})
            if time.monotonic() - self._started < self.spec.adopt_after_s:
                continue
            if self.accepting is not None and not self.accepting.is_set():
                continue  # drained: a departed worker's jobs are for the others
            for info in infos:
                self._maybe_adopt(info)

    async def _keep_own_consumer(self, names: set[str | None]) -> None:
        name = self.spec.consumer_name(self.worker_id)
        if name in names:
            self._problem = None
            return
        if self.stopping.is_set():
            return
        # The listing is one page (256 consumers): ask for ours by name before making it.
        await self.check()
        if self._problem is None:  # it is there, or JetStream did not say it is not
            return
        log.warning("consumer %s is gone; making it again", name)
        try:
            await self._add_own_consumer()
        except Exception:
            log.exception("making consumer %s again failed", name)
            return
        # Our pull subscription asks for jobs by the consumer's name: it goes on as before.
        self._problem = None

    def _maybe_adopt(self, info: ConsumerInfo) -> None:
        name = info.name or ""
        if not name.startswith(self.spec.consumer_prefix):
            return
        worker_id = name[len(self.spec.consumer_prefix) :]
        if worker_id == self.worker_id or worker_id in self.adopting or self.alive(worker_id):
            return
        waiting = (info.num_pending or 0) + (info.num_ack_pending or 0)
        if not waiting:
            return
        log.warning("worker %s is gone with %d jobs; taking them", worker_id, waiting)
        self.adopting.add(worker_id)
        assert self._tg is not None
        self._tg.create_task(self._adopt(worker_id), name=f"adopt {worker_id}")

    async def _adopt(self, worker_id: str) -> None:
        name = self.spec.consumer_name(worker_id)
        stream = self.spec.stream
        try:
            psub = await self.bus.js.pull_subscribe_bind(name, stream)
            # Stay until ack_wait has surely expired on everything it held, then a bit.
            await self._consume(psub, adopted=True, until_idle_s=2 * self.spec.ack_wait_s)
            info = await self.bus.js.consumer_info(stream, name)
            if not self.alive(worker_id) and not (info.num_pending or info.num_ack_pending):
                await self._remove_departed(name)
        except NotFoundError:
            pass
        except Exception:
            log.exception("adopting the jobs of %s failed", worker_id)
        finally:
            self.adopting.discard(worker_id)

    async def _remove_departed(self, name: str) -> None:
        """Delete a departed worker's emptied consumer where our NATS user may (a worker's
        may not: tokenyard.bus.auth); else its inactivity threshold removes it."""
        try:
            await self.bus.js.delete_consumer(self.spec.stream, name)
        except Exception as exc:
            log.info("left consumer %s to expire (%s)", name, type(exc).__name__)
        else:
            log.info("removed consumer %s of a departed worker", name)
