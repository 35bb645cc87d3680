"""Prefill role: take jobs from the JetStream work queue, prefill, hand off to a decode worker.

The queue (tokenyard.bus.workqueue) pins jobs to workers (the router places a dead worker's
jobs again: tokenyard.bus.orphans), and acks a job only when :meth:`PrefillHandler.run` says it is done: handed to a
decode worker, or finished here. This module keeps what a prefill job means.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from tokenyard.bus import auth, subjects
from tokenyard.bus.workqueue import Delivery, Outcome, WorkQueue, WorkQueueSpec
from tokenyard.kv.hashing import adapter_salt
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.convert import error_chunk
from tokenyard.services.worker.kvcache import PrefixHit
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.services.worker.stream import HANDED_BACK
from tokenyard.tracing import REQUEST_ID, WORKER_ID, tracer
from tokenyard.v1 import serving_pb2 as pb

if TYPE_CHECKING:
    from tokenyard.kv.store.engine_bridge import StagedPrefix

_tracer = tracer("tokenyard.worker")
log = logging.getLogger(__name__)

CONSUMER_PREFIX = auth.PREFILL_CONSUMER_PREFIX


def queue_spec(settings: WorkerSettings) -> WorkQueueSpec:
    return WorkQueueSpec(
        stream=subjects.PREFILL_STREAM,
        subjects=subjects.PREFILL_SUBJECTS,
        consumer_prefix=CONSUMER_PREFIX,
        subject_for=subjects.prefill_worker_jobs,
        ack_wait_s=settings.job_ack_wait_s,
        max_deliver=settings.job_max_deliver,
        max_in_flight=settings.max_num_seqs + settings.max_queued_jobs,
        replicas=settings.jetstream_replicas,
    )


class PrefillHandler:
    def __init__(self, worker: WorkerBase) -> None:
        self.w = worker
        self.settings = worker.settings
        self.bus = worker.bus
        self.cache = worker.kvcache
        self.queue = WorkQueue(
            self.bus,
            queue_spec(self.settings),
            worker.worker_id,
            pb.PrefillJob,
            self,
            stopping=worker.stopping,
            accepting=worker.accepting,
        )
        worker.presence.readiness_checks.append(self.queue.problem)
        worker.presence.kvcache_fetch_ms_per_block = lambda: self.cache.fetch_ms_per_block

    async def start(self, tg: asyncio.TaskGroup) -> None:
        await self.queue.start(tg)

    async def remove_own_consumer_if_empty(self) -> None:
        await self.queue.remove_own_consumer_if_empty()

    # --- the queue's handler -------------------------------------------------------------

    async def run(self, delivery: Delivery[pb.PrefillJob]) -> Outcome:
        job = delivery.job
        if not job.gateway_id:  # nobody could read its tokens: a malformed job
            log.warning("dropping job %s: it names no gateway", job.request_id)
            return Outcome.DONE
        if delivery.moved or delivery.attempt > 1:
            log.info(
                "job %s redelivered (delivery %d, moved %d times)",
                job.request_id,
                delivery.attempt,
                delivery.moved,
            )
        # A redelivery of a job still running here waits for it, never re-adds it.
        done = await self.w.streams.run_once(job.request_id, lambda: self.run_job(job))
        return Outcome.DONE if done else Outcome.HAND_BACK  # handed back: a live worker takes it

    async def give_up(self, delivery: Delivery[pb.PrefillJob], error: Exception) -> None:
        """The job failed on every delivery: tell the client instead of going silent."""
        rid = delivery.job.request_id
        chunk = error_chunk(
            rid, 0, self.w.worker_id, pb.Error.INTERNAL, f"the request failed: {error}"
        )
        subject = subjects.tokens(delivery.job.gateway_id, rid, self.w.worker_id)
        await self.bus.publish(subject, chunk)

    # --- one job -------------------------------------------------------------------------

    async def run_job(self, job: pb.PrefillJob) -> bool:
        """Run a job; False = hand it back (we are stopping), True = done (ack it)."""
        rid = job.request_id
        if self.w.streams.is_cancelled(rid) or self.w.streams.finished_here(rid):
            return True  # a late redelivery: nothing left to do
        # A pooling (embedding) request asks for max_tokens 1: it runs whole here too.
        aggregated = job.decode_worker_id in ("", self.w.worker_id) or job.params.max_tokens == 1
        prompt = list(job.prompt_token_ids)
        salt = adapter_salt(job.params.cache_salt, job.params.lora)  # the prefix cache's
        # NOTE: mean pooling computes every prompt token: a fetched prefix would go unused.
        wanted = job.params.pooling != "mean"
        # The fetch of a shared hit runs while the request waits for admission here, into
        # host memory; admitted, its landing is queued right before the add, so both run at
        # the next step boundary and the request is schedulable in that step.
        staging = asyncio.get_running_loop().create_task(self._stage(rid, prompt, salt, wanted))
        landed: list[asyncio.Future[PrefixHit]] = []

        async def before_add() -> None:
            staged = await asyncio.shield(staging)
            landed.append(self.cache.land_soon(rid, staged, salt))

        def hit_now() -> PrefixHit:
            done = bool(landed) and landed[0].done() and not landed[0].cancelled()
            return landed[0].result() if done else PrefixHit(0, 0)

        try:
            stream = await self.w.generate(
                rid,
                job.gateway_id,
                prompt,
                job.params,
                prefill_only=not aggregated,
                arrival_unix_ns=job.arrival_unix_ns,
                on_prompt_computed=lambda: self._offload_prompt(
                    rid, prompt, staging, hit_now(), salt
                ),
                before_add=before_add,
            )
        finally:
            await staging  # never cancelled; it holds no engine blocks either way
            hit = await landed[0] if landed else PrefixHit(0, 0)
        reason = await stream.done
        if reason == HANDED_BACK:
            return False
        self._account(prompt, stream.cached_tokens or 0, hit)
        if reason != "prefilled":
            self.cache.offload_reply(rid, prompt, stream.output_token_ids, salt, reason)
            return True
        here = await self.w.handoffs.send(job, stream.cached_tokens or 0)
        if here is not None:  # refused by its decode worker: decoded here
            reason = await here.done
            self.cache.offload_reply(rid, prompt, here.output_token_ids, salt, reason)
        return True

    async def _stage(
        self, rid: str, prompt: list[int], salt: str, wanted: bool
    ) -> StagedPrefix | None:
        if not wanted:
            return None
        attributes = {REQUEST_ID: rid, WORKER_ID: self.w.worker_id}
        with _tracer.start_as_current_span("kvcache.fetch", attributes=attributes) as span:
            staged = await self.cache.stage(rid, prompt, salt)
            span.set_attribute(
                "tokenyard.fetched_tokens",
                0 if staged is None else staged.num_fetched * staged.block_size,
            )
        return staged

    def _offload_prompt(
        self,
        rid: str,
        prompt: list[int],
        staging: asyncio.Task[StagedPrefix | None],
        hit: PrefixHit,
        salt: str,
    ) -> None:
        # With the first token, while the sequence still holds its prompt's blocks, not
        # when it ends: a closed-loop client's next request arrives as one ends, and the
        # copy-out and upload then competed with its prefill, slowing its first token
        # (docs/benchmarks.md). In the background: the copy-out waits for a step boundary.
        # Neither what the engine held or fetched nor what the service held already (the
        # other worker sent it) is sent again.
        staged = staging.result() if staging.done() and not staging.cancelled() else None
        stored = 0 if staged is None else staged.stored * staged.block_size
        skip = max(hit.cached_tokens, stored)
        self.cache.offload_soon(rid, prompt, skip_tokens=skip, cache_salt=salt)

    def _account(self, prompt: list[int], cached_tokens: int, hit: PrefixHit) -> None:
        """Prompt tokens served by each tier (the engine's count includes the fetched ones)."""
        fetched = min(hit.fetched_tokens, cached_tokens)
        self.w.metrics.on_kv_hits(cached_tokens - fetched, fetched)
