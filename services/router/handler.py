"""The router's NATS handlers: heartbeats, rack states and KV events in, placements out."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.facilities.tracker import RackStateTracker
from tokenyard.fleet import FleetView
from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.routing.policy import PolicyConfig, RouteInput, choose
from tokenyard.services.router.kv_sync import KVSync
from tokenyard.services.router.lora_loads import LoRALoads
from tokenyard.services.router.shared_tier import SharedTier
from tokenyard.services.router.state import BlockIndex
from tokenyard.tracing import REQUEST_ID, tracer
from tokenyard.v1 import serving_pb2 as pb

_tracer = tracer("tokenyard.router")
log = logging.getLogger(__name__)

RESYNC_TIMEOUT_S = 5.0  # a worker answers at once, between two engine steps
RESYNC_RETRY_S = 1.0  # after a failed resync, wait this long before asking that worker again


class RouterHandler:
    def __init__(
        self,
        bus: Bus,
        config: PolicyConfig,
        *,
        racks: RackStateTracker | None = None,
        shared: SharedTier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.shared = shared  # the KV-cache service, asked what it holds of each prompt
        self.config = config
        self.clock = clock
        self.turns = itertools.count()  # round-robin placement's turn
        # Heartbeats and the facilities service's rack states (every rack normal until one
        # arrives on ty.facilities.state.*).
        self.fleet = FleetView(config.missed_heartbeats, racks=racks)
        self.index = BlockIndex()
        self.kv = KVSync(self.index)
        self._resyncs: dict[str, asyncio.Task[None]] = {}  # worker id -> its resync, one at a time
        # A busy adapter copied to a worker with room (routing.lora_placement).
        self.lora_loads = LoRALoads(bus, self.fleet, config, clock)

    def worker_alive(self, worker_id: str) -> bool:
        return self.fleet.alive(worker_id, self.clock())

    def place_again(self, job: pb.PrefillJob, gone: str) -> tuple[str, pb.PrefillJob] | None:
        """Where a job goes that its prefill worker left behind, dead (tokenyard.bus.orphans):
        the least loaded ready worker that prefills its model; None while there is none, or
        while `gone` is alive. The moved job is the same request (its id, gateway, prompt
        and parameters), with only its decode worker cleared when that was `gone` too."""
        now = self.clock()
        if self.fleet.alive(gone, now):
            return None
        takers = [
            w
            for w in self.fleet.ready(now)
            if w.prefills and not w.draining and (not job.model or w.model == job.model)
        ]
        if not takers:
            return None
        target = min(takers, key=lambda w: (w.load, w.worker_id))
        moved = pb.PrefillJob()
        moved.CopyFrom(job)
        if job.decode_worker_id == gone:  # it was to run both roles there: it does so here
            moved.decode_worker_id = ""
        decodes = moved.decode_worker_id in ("", target.worker_id)
        self.fleet.placed(
            target.worker_id, decodes=decodes, prompt_tokens=len(job.prompt_token_ids)
        )
        return target.worker_id, moved

    async def announce_move(self, job: pb.PrefillJob, gone: str, target: str) -> None:
        """Tell the request's gateway where its job went (it takes the new worker's tokens
        only when its own fleet view agrees that `gone` is dead and `target` alive)."""
        if not job.gateway_id:
            return
        moved = pb.JobMoved(
            request_id=job.request_id,
            from_worker_id=gone,
            to_worker_id=target,
            decode_worker_id=job.decode_worker_id,
        )
        await self.bus.publish(subjects.moved(job.gateway_id, job.request_id), moved)

    async def on_heartbeat(self, hb: pb.WorkerHeartbeat, _msg: Msg) -> None:
        if hb.worker_id not in self.fleet:
            log.info("worker %s (%s, %s) joined", hb.worker_id, hb.role, hb.model)
        self.fleet.on_heartbeat(hb, self.clock())
        if self.kv.on_heartbeat(hb):
            self._resync(hb.worker_id, "its heartbeat says we miss KV events")

    async def on_kv_event(self, event: pb.KVEvent, _msg: Msg) -> None:
        if self.kv.on_event(event):
            self._resync(event.worker_id, f"KV event {event.seq} of {event.epoch!r} out of order")

    def _resync(self, worker_id: str, reason: str) -> None:
        if worker_id in self._resyncs:
            return
        task = asyncio.get_running_loop().create_task(self._ask_dump(worker_id, reason))
        self._resyncs[worker_id] = task
        task.add_done_callback(lambda _: self._resyncs.pop(worker_id, None))

    async def _ask_dump(self, worker_id: str, reason: str) -> None:
        """Ask the worker for its cached blocks until its part of the index is whole again."""
        log.info("resyncing the KV index of %s: %s", worker_id, reason)
        request = pb.KVResyncRequest(worker_id=worker_id, reason=reason)
        again = True
        while again:
            try:
                dump = await self.bus.request(
                    subjects.kv_resync(worker_id), request, pb.KVDump, timeout=RESYNC_TIMEOUT_S
                )
            except Exception as exc:  # gone, or not answering: the next event or beat asks again
                log.info("KV resync of %s failed: %s", worker_id, type(exc).__name__)
                await asyncio.sleep(RESYNC_RETRY_S)
                self.kv.resync_failed(worker_id)
                return
            if dump.worker_id != worker_id:  # only worker_id may answer on its subject
                log.warning("dropping a KV dump of %s asked of %s", dump.worker_id, worker_id)
                self.kv.resync_failed(worker_id)
                return
            again = self.kv.on_dump(dump)
            log.info(
                "KV index of %s rebuilt: %d blocks as of event %d%s",
                worker_id,
                len(dump.block_hashes),
                dump.seq,
                " (the most recent: more than one message holds)" if dump.truncated else "",
            )

    async def close(self) -> None:
        """Stop the resyncs in flight."""
        await self.lora_loads.close()
        tasks = list(self._resyncs.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def on_route(self, req: pb.RouteRequest, msg: Msg) -> None:
        # A child of the gateway's span: the bus restored its context for this handler.
        with _tracer.start_as_current_span(
            "router.route",
            attributes={
                REQUEST_ID: req.request_id,
                "tokenyard.prompt_tokens": req.num_prompt_tokens,
            },
        ) as span:
            shared = await self.shared_blocks(req)
            span.set_attribute("tokenyard.shared_blocks", shared)
            reply = self.route(req, shared_blocks=shared)
            if req.lora:
                self.lora_loads.consider(lora_input(req), self.fleet.racks.by_worker())
            span.set_attributes(placement_attributes(reply))
            await self.bus.reply(msg, reply)

    async def shared_blocks(self, req: pb.RouteRequest) -> int:
        """Leading blocks of the prompt the shared tier holds (0 without one, or when a
        worker holds the whole prompt already: the service could add nothing)."""
        hashes = list(req.block_hashes)
        if self.shared is None or not hashes or req.hash_version not in ("", HASH_SPEC_VERSION):
            return 0
        layout = self.fleet.kv_layout(req.model, self.clock())
        if layout is None:
            return 0
        if max(self.index.overlap(hashes).values(), default=0) >= len(hashes):
            return 0
        return await self.shared.leading_blocks(layout, hashes)

    def route(self, req: pb.RouteRequest, shared_blocks: int = 0) -> pb.RouteReply:
        now = self.clock()
        for worker_id in self.fleet.forget_dead(now):
            log.info("worker %s is gone", worker_id)
            self.kv.forget(worker_id)
        cached = (
            self.index.overlap(list(req.block_hashes))
            if req.hash_version in ("", HASH_SPEC_VERSION)
            else {}
        )
        request = RouteInput(
            req.request_id,
            req.model,
            req.num_prompt_tokens,
            cached,
            max_tokens=req.max_tokens,
            turn=next(self.turns),
            shared_blocks=shared_blocks,
            priority=req.priority,
            lora=req.lora,
        )
        facilities = self.fleet.racks.by_worker()
        result = choose(self.fleet.workers, request, now, facilities=facilities, config=self.config)
        if isinstance(result, pb.RouteError):
            log.info("route %s: %s", req.request_id, result.message)
            return pb.RouteReply(error=result)
        uncached = max(0, req.num_prompt_tokens - result.expected_cached_tokens)
        self.fleet.placed(
            result.prefill_worker_id,
            decodes=not result.disaggregated,
            prompt_tokens=uncached,
        )
        if result.disaggregated:
            self.fleet.placed(result.decode_worker_id)
        log.debug(
            "route %s -> %s/%s (%s)",
            req.request_id,
            result.prefill_worker_id,
            result.decode_worker_id,
            result.reason,
        )
        return pb.RouteReply(placement=result)


def lora_input(req: pb.RouteRequest) -> RouteInput:
    """What routing.lora_placement reads of a request."""
    return RouteInput(
        req.request_id, req.model, req.num_prompt_tokens, max_tokens=req.max_tokens, lora=req.lora
    )


def placement_attributes(reply: pb.RouteReply) -> dict[str, str | bool]:
    if reply.HasField("error"):
        return {"tokenyard.route_error": reply.error.message}
    p = reply.placement
    return {
        "tokenyard.prefill_worker": p.prefill_worker_id,
        "tokenyard.decode_worker": p.decode_worker_id,
        "tokenyard.disaggregated": p.disaggregated,
        "tokenyard.route_reason": p.reason,
    }
