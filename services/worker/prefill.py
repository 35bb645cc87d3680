"""Prefill role: take jobs from the JetStream work queue, prefill, hand off to a decode worker.

Each prefill worker pulls from a durable consumer named after itself, filtered on its own
subject (the router pins jobs to workers). A job is acked only once it is safe: handed to a
decode worker, or finished here. A worker that dies leaves its unacked jobs in its consumer;
live workers notice it is gone (no heartbeats) and fetch from that consumer too, so the
jobs are redelivered to them once ack_wait runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BadRequestError, NotFoundError

from tokenyard.bus import subjects
from tokenyard.bus.nats import BusError, parse
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.convert import error_chunk
from tokenyard.services.worker.kv import KVCachePort
from tokenyard.services.worker.stream import HANDED_BACK
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

CONSUMER_PREFIX = "prefill-"
FETCH_TIMEOUT_S = 1.0
ORPHAN_SCAN_S = 1.0
CONSUMER_INACTIVE_S = 3600.0


def consumer_name(worker_id: str) -> str:
    return f"{CONSUMER_PREFIX}{worker_id}"


class PrefillHandler:
    def __init__(self, worker: WorkerBase) -> None:
        self.w = worker
        self.settings = worker.settings
        self.bus = worker.bus
        self.slots = asyncio.Semaphore(self.settings.max_num_seqs)
        self.adopted: set[str] = set()
        self.cache = KVCachePort(worker.loop, worker.settings)
        self._tg: asyncio.TaskGroup | None = None
        self._started = time.monotonic()

    def consumer_config(self, worker_id: str) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=consumer_name(worker_id),
            filter_subject=subjects.prefill_worker_jobs(worker_id),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.settings.job_ack_wait_s,
            max_deliver=self.settings.job_max_deliver,
            # A consumer nobody pulls from (its worker gone, nobody adopted it) goes away by
            # itself instead of piling up on a long-lived NATS.
            inactive_threshold=CONSUMER_INACTIVE_S,
        )

    async def start(self, tg: asyncio.TaskGroup) -> None:
        self._tg = tg
        await self.cache.start()
        await self.bus.ensure_work_queue(
            subjects.PREFILL_STREAM, [subjects.PREFILL_JOBS, f"{subjects.PREFILL_JOBS}.>"]
        )
        config = self.consumer_config(self.w.worker_id)
        try:
            await self.bus.js.add_consumer(subjects.PREFILL_STREAM, config)
        except BadRequestError as exc:  # ours from an earlier run, with other settings: reuse it
            log.info("reusing consumer %s (%s)", config.durable_name, exc.description)
        psub = await self.bus.js.pull_subscribe_bind(config.durable_name, subjects.PREFILL_STREAM)
        tg.create_task(self._consume(psub, own=True), name="prefill-consume")
        tg.create_task(self._adopt_orphans(), name="prefill-adopt")

    # --- consuming -----------------------------------------------------------------------

    async def _consume(self, psub, *, own: bool, until_idle_s: float | None = None) -> None:
        """Fetch one job per free slot; an adopted consumer is left once idle for a while."""
        idle_since = time.monotonic()
        try:
            while not self.w.stopping.is_set():
                await self.slots.acquire()
                try:
                    msgs = await psub.fetch(1, timeout=FETCH_TIMEOUT_S)
                except (NatsTimeoutError, TimeoutError):
                    self.slots.release()
                    if until_idle_s is not None and time.monotonic() - idle_since > until_idle_s:
                        return
                    continue
                except Exception:
                    self.slots.release()
                    if self.w.stopping.is_set():
                        return
                    log.exception("fetching prefill jobs failed")
                    await asyncio.sleep(FETCH_TIMEOUT_S)
                    continue
                idle_since = time.monotonic()
                assert self._tg is not None
                for msg in msgs:
                    self._tg.create_task(self._run_job(msg, own=own))
        finally:
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def _run_job(self, msg: Msg, *, own: bool) -> None:
        try:
            job = parse(pb.PrefillJob, msg.data)
        except BusError:
            log.warning("dropping an undecodable prefill job")
            await msg.term()
            self.slots.release()
            return
        try:
            if not own or msg.metadata.num_delivered > 1:
                log.info(
                    "job %s redelivered (delivery %d)", job.request_id, msg.metadata.num_delivered
                )
            async with self._in_progress(msg):
                # A redelivery of a job still running here waits for it, never re-adds it.
                done = await self.w.run_once(job.request_id, lambda: self.run_job(job))
            await (msg.ack() if done else msg.nak())  # nak: handed back, a live worker takes it
        except Exception as exc:
            log.exception("prefill job %s failed", job.request_id)
            await self._failed(job, msg, exc)
        finally:
            self.slots.release()

    async def _failed(self, job: pb.PrefillJob, msg: Msg, exc: Exception) -> None:
        """Retry on another delivery; on the last one, tell the client instead of going silent."""
        with contextlib.suppress(Exception):
            if msg.metadata.num_delivered < self.settings.job_max_deliver:
                await msg.nak()
                return
            await msg.term()
            chunk = error_chunk(
                job.request_id, 0, self.w.worker_id, pb.Error.INTERNAL, f"the request failed: {exc}"
            )
            await self.bus.publish(subjects.tokens(job.request_id), chunk)

    @contextlib.asynccontextmanager
    async def _in_progress(self, msg: Msg) -> AsyncIterator[None]:
        """Keep JetStream from redelivering a job while we are still working on it."""

        async def tick() -> None:
            while True:
                await asyncio.sleep(self.settings.job_ack_wait_s / 3)
                with contextlib.suppress(Exception):
                    await msg.in_progress()

        task = asyncio.create_task(tick())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # --- one job -------------------------------------------------------------------------

    async def run_job(self, job: pb.PrefillJob) -> bool:
        """Run a job; False = hand it back (we are stopping), True = done (ack it)."""
        rid = job.request_id
        if self.w.is_cancelled(rid):
            return True
        aggregated = job.decode_worker_id in ("", self.w.worker_id) or job.params.max_tokens == 1
        prompt = list(job.prompt_token_ids)
        fetched = await self.cache.fetch(rid, prompt)
        stream = await self.w.generate(
            rid,
            prompt,
            job.params,
            prefill_only=not aggregated,
            arrival_unix_ns=job.arrival_unix_ns,
        )
        reason = await stream.done
        if reason == HANDED_BACK:
            return False
        if reason in ("prefilled", "stop", "length"):
            # Its blocks are still in the prefix cache (held, or freed but not yet evicted).
            await self.cache.offload(rid, prompt, skip_tokens=fetched)
        if reason != "prefilled":
            return True
        await self._hand_off(job, stream.cached_tokens or 0)
        return True

    async def _hand_off(self, job: pb.PrefillJob, cached_tokens: int) -> None:
        rid = job.request_id
        exported = await self.w.loop.call(self.w.engine.export_sequence, rid)
        if self.w.is_cancelled(rid):
            await self.w.kv.end_hold(rid, "cancelled")
            return
        endpoint = self.w.kv.offer(rid, list(exported.block_ids))
        handoff = pb.DecodeHandoff(
            request_id=rid,
            model=job.model,
            prompt_token_ids=exported.prompt_token_ids,
            output_token_ids=exported.output_token_ids,
            params=job.params,
            prefill_worker_id=self.w.worker_id,
            kv_endpoint=endpoint,
            src_block_ids=exported.block_ids,
            num_cached_tokens=cached_tokens,
            arrival_unix_ns=job.arrival_unix_ns,
        )
        accepted = await self._send(job.decode_worker_id, handoff)
        if not endpoint or not accepted:
            await self.w.kv.end_hold(rid, "not pulled")
        if not accepted and self.w.is_cancelled(rid):
            return
        if not accepted:
            log.warning(
                "decode worker %s did not take %s; decoding it here", job.decode_worker_id, rid
            )
            await self.w.decode_here(handoff)

    async def _send(self, decode_worker_id: str, handoff: pb.DecodeHandoff) -> bool:
        try:
            ack = await self.bus.request(
                subjects.decode_jobs(decode_worker_id),
                handoff,
                pb.HandoffAck,
                timeout=self.settings.handoff_timeout_s,
            )
        except Exception as exc:  # no responders, timeout, connection trouble: decode here
            log.info(
                "hand-off of %s to %s failed: %s",
                handoff.request_id,
                decode_worker_id,
                type(exc).__name__,
            )
            return False
        if not ack.accepted:
            log.info(
                "decode worker %s refused %s: %s", decode_worker_id, handoff.request_id, ack.message
            )
        return ack.accepted

    # --- dead workers' jobs --------------------------------------------------------------

    async def _adopt_orphans(self) -> None:
        """Fetch from the consumers of prefill workers that stopped beating."""
        grace = 3 * self.settings.heartbeat_interval_s
        while not self.w.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.w.stopping.wait(), ORPHAN_SCAN_S)
                return
            if time.monotonic() - self._started < grace:
                continue  # we have not heard everyone's heartbeat yet
            try:
                infos = await self.bus.js.consumers_info(subjects.PREFILL_STREAM)
            except Exception:
                log.debug("listing prefill consumers failed", exc_info=True)
                continue
            for info in infos:
                self._maybe_adopt(info)

    def _maybe_adopt(self, info) -> None:
        name = info.name or ""
        if not name.startswith(CONSUMER_PREFIX):
            return
        worker_id = name[len(CONSUMER_PREFIX) :]
        if (
            worker_id == self.w.worker_id
            or worker_id in self.adopted
            or self.w.peer_alive(worker_id)
        ):
            return
        if not (info.num_pending or info.num_ack_pending):
            return
        log.warning(
            "prefill worker %s is gone with %d jobs; taking them",
            worker_id,
            info.num_pending + info.num_ack_pending,
        )
        self.adopted.add(worker_id)
        assert self._tg is not None
        self._tg.create_task(self._adopt(worker_id), name=f"adopt {worker_id}")

    async def _adopt(self, worker_id: str) -> None:
        name = consumer_name(worker_id)
        try:
            psub = await self.bus.js.pull_subscribe_bind(name, subjects.PREFILL_STREAM)
            # Stay until ack_wait has surely expired on everything it held, then a bit.
            await self._consume(psub, own=False, until_idle_s=2 * self.settings.job_ack_wait_s)
            info = await self.bus.js.consumer_info(subjects.PREFILL_STREAM, name)
            if not self.w.peer_alive(worker_id) and not (info.num_pending or info.num_ack_pending):
                await self.bus.js.delete_consumer(subjects.PREFILL_STREAM, name)
                log.info("removed the consumer of departed worker %s", worker_id)
        except NotFoundError:
            pass
        except Exception:
            log.exception("adopting %s failed", worker_id)
        finally:
            self.adopted.discard(worker_id)

    # --- stopping ------------------------------------------------------------------------

    async def remove_own_consumer_if_empty(self) -> None:
        name = consumer_name(self.w.worker_id)
        with contextlib.suppress(Exception):
            info = await self.bus.js.consumer_info(subjects.PREFILL_STREAM, name)
            if not (info.num_pending or info.num_ack_pending):
                await self.bus.js.delete_consumer(subjects.PREFILL_STREAM, name)
