"""The jobs a departed worker left in its work-queue consumer, placed again by the router.

A worker pulls only from its own consumer (tokenyard.bus.workqueue), and its NATS user may
touch no other (tokenyard.bus.auth): a worker's password must not take jobs pinned to a
peer. So when a worker dies with jobs in its consumer (unacked, or not yet fetched), the
party that placed them places them again: the router, which already decides where a job
runs, drains that consumer and publishes each job pinned to a live worker of its choice.

    scan (each scan_interval_s) --> consumer <prefix><w>, w not alive, jobs waiting
        --> fetch each job (an unacked one once its ack_wait runs out)
        --> place(job, w) -> (worker, job)  --> announce(job, w, worker) (the request's gateway
                                                takes the new worker's tokens), publish pinned
                                                to it, then ack the old copy
                          -> None (nobody)  --> held in progress, asked again each scan
                                                (nak'd at once if the worker comes back)
        --> idle for two ack_waits and empty --> delete the consumer

A job moved more than `max_moves` times (it kills every worker it lands on) is dropped,
with a log line: the gateway then ends the request as its worker lost.

    orphans = OrphanedJobs(bus, stream, "prefill-", subjects.prefill_worker_jobs,
                           pb.PrefillJob, place=..., alive=..., announce=..., stopping=stop)
    tg.create_task(orphans.run())

What the router may do here is bounded by who checks it, not by the router's own code (its
NATS password could run other code): a gateway takes a moved request's tokens from the new
worker only when its own fleet view says the old one is dead and the new one alive
(tokenyard.services.gateway.senders), and the new worker runs the job under the request's
own id, so it joins, never doubles, a copy already running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Generic, TypeVar

from google.protobuf.message import Message
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from tokenyard.bus.nats import Bus, BusError, parse

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

MOVES_HEADER = "Tokenyard-Moves"  # how many times a job was placed again so far
MSG_ID_HEADER = "Nats-Msg-Id"
DEFAULT_ACK_WAIT_S = 30.0


class OrphanedJobs(Generic[M]):
    def __init__(
        self,
        bus: Bus,
        stream: str,
        consumer_prefix: str,
        subject_for: Callable[[str], str],
        message_type: type[M],
        *,
        place: Callable[[M, str], tuple[str, M] | None],
        alive: Callable[[str], bool],
        stopping: asyncio.Event,
        announce: Callable[[M, str, str], Awaitable[None]] | None = None,
        grace_s: float,
        scan_interval_s: float = 1.0,
        fetch_timeout_s: float = 1.0,
        max_moves: int = 3,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.consumer_prefix = consumer_prefix
        self.subject_for = subject_for
        self.message_type = message_type
        self.place = place  # (job, departed worker) -> (the worker to run it, the job to send)
        self.alive = alive
        self.announce = announce  # (job, departed worker, new worker): tell who waits for it
        self.stopping = stopping
        # Move nothing this soon after start: the workers' heartbeats are not heard yet.
        self.grace_s = grace_s
        self.scan_interval_s = scan_interval_s
        self.fetch_timeout_s = fetch_timeout_s
        self.max_moves = max_moves
        self.moving: dict[str, asyncio.Task[None]] = {}  # departed worker id -> its drain
        self._started = time.monotonic()

    async def run(self) -> None:
        """Scan until stopping; then wait for the drains under way to end."""
        self._started = time.monotonic()
        try:
            while not self.stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), self.scan_interval_s)
                    break
                if time.monotonic() - self._started >= self.grace_s:
                    await self.scan()
        finally:
            for task in list(self.moving.values()):
                task.cancel()
            await asyncio.gather(*self.moving.values(), return_exceptions=True)

    async def scan(self) -> None:
        try:
            infos = await self.bus.js.consumers_info(self.stream)
        except Exception as exc:  # no stream yet, JetStream busy: the next scan asks again
            log.debug("listing the consumers of %s failed: %s", self.stream, exc)
            return
        for info in infos:
            worker_id = self._departed_with_jobs(info)
            if worker_id is not None:
                log.warning("worker %s is gone with jobs; placing them again", worker_id)
                task = asyncio.create_task(self._move_all(worker_id, info))
                self.moving[worker_id] = task
                task.add_done_callback(partial(self._moved, worker_id))

    def _moved(self, worker_id: str, _task: asyncio.Task[None]) -> None:
        self.moving.pop(worker_id, None)

    def _departed_with_jobs(self, info: ConsumerInfo) -> str | None:
        name = info.name or ""
        if not name.startswith(self.consumer_prefix):
            return None
        worker_id = name[len(self.consumer_prefix) :]
        if worker_id in self.moving or self.alive(worker_id):
            return None
        return worker_id if (info.num_pending or 0) + (info.num_ack_pending or 0) else None

    async def _move_all(self, worker_id: str, info: ConsumerInfo) -> None:
        """Drain the departed worker's consumer until idle for two ack_waits, then delete it
        once empty (unless the worker came back meanwhile)."""
        name = self.consumer_prefix + worker_id
        ack_wait = info.config.ack_wait or DEFAULT_ACK_WAIT_S
        try:
            psub = await self.bus.js.pull_subscribe_bind(name, self.stream)
            try:
                await self._drain(psub, worker_id, until_idle_s=2 * ack_wait)
            finally:
                with contextlib.suppress(Exception):
                    await psub.unsubscribe()
            left = await self.bus.js.consumer_info(self.stream, name)
            if not self.alive(worker_id) and not (left.num_pending or left.num_ack_pending):
                await self.bus.js.delete_consumer(self.stream, name)
                log.info("removed the consumer of departed worker %s", worker_id)
        except NotFoundError:
            pass
        except Exception:
            log.exception("placing the jobs of %s again failed", worker_id)

    async def _drain(self, psub: Any, worker_id: str, *, until_idle_s: float) -> None:
        idle_since = time.monotonic()
        while not self.stopping.is_set() and not self.alive(worker_id):
            try:
                msgs = await psub.fetch(1, timeout=self.fetch_timeout_s)
            except (NatsTimeoutError, TimeoutError):
                if time.monotonic() - idle_since > until_idle_s:
                    return
                continue
            idle_since = time.monotonic()
            for msg in msgs:
                await self._move(msg, worker_id)

    async def _move(self, msg: Msg, worker_id: str) -> None:
        try:
            job = parse(self.message_type, msg.data)
        except BusError:
            log.warning("dropping an undecodable %s", self.message_type.__name__)
            await msg.term()
            return
        moves = int((msg.headers or {}).get(MOVES_HEADER, "0")) + 1
        if moves > self.max_moves:
            log.error("dropping a job moved %d times already (worker %s)", moves - 1, worker_id)
            await msg.term()
            return
        placed = self.place(job, worker_id)
        while placed is None:  # no live worker can take it now: hold it until one can
            # NOTE: held (in progress), not nak'd: every nak is a delivery, and a job nak'd
            # each second while the only worker restarts ran out of its max_deliver and was
            # never delivered again.
            if self.stopping.is_set() or self.alive(worker_id):
                await msg.nak()  # its worker is back (restarted): it takes it itself
                return
            await msg.in_progress()
            await asyncio.sleep(self.scan_interval_s)
            placed = self.place(job, worker_id)
        target, job = placed
        if self.alive(worker_id):  # back while we placed it: its own consumer runs it
            await msg.nak()
            return
        if self.announce is not None:
            await self.announce(job, worker_id, target)
        headers = dict(msg.headers or {})
        headers[MOVES_HEADER] = str(moves)
        # NOTE: a fresh id: the publisher's own would be a duplicate inside JetStream's
        # window and dropped; this one keeps a retry of the same move from doubling it.
        headers[MSG_ID_HEADER] = f"moved-{msg.metadata.sequence.stream}-{moves}"
        await self.bus.js.publish(
            self.subject_for(target), job.SerializeToString(), headers=headers
        )
        await msg.ack()
        log.info("moved a job of departed worker %s to %s", worker_id, target)
