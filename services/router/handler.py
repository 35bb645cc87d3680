"""The router's NATS handlers: heartbeats and KV events in, placements out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from nats.aio.msg import Msg

from tokenyard.bus.nats import Bus
from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.services.router.policy import FacilityState, PolicyConfig, RouteInput, choose
from tokenyard.services.router.state import BlockIndex, WorkerTable
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

# The facilities hook: per worker id, its rack's state. The facilities service wires a
# RackStateTracker in here; until then every rack is normal.
FacilitiesSource = Callable[[], Mapping[str, FacilityState]]


def no_facilities() -> Mapping[str, FacilityState]:
    return {}


class RouterHandler:
    def __init__(
        self,
        bus: Bus,
        config: PolicyConfig,
        *,
        facilities: FacilitiesSource = no_facilities,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.config = config
        self.facilities = facilities
        self.clock = clock
        self.workers = WorkerTable()
        self.index = BlockIndex()

    async def on_heartbeat(self, hb: pb.WorkerHeartbeat, _msg: Msg) -> None:
        if hb.worker_id not in self.workers.workers:
            log.info("worker %s (%s, %s) joined", hb.worker_id, hb.role, hb.model)
        self.workers.on_heartbeat(hb, self.clock())

    async def on_kv_event(self, event: pb.KVEvent, _msg: Msg) -> None:
        self.index.on_event(event)

    async def on_route(self, req: pb.RouteRequest, msg: Msg) -> None:
        await self.bus.reply(msg, self.route(req))

    def route(self, req: pb.RouteRequest) -> pb.RouteReply:
        now = self.clock()
        for worker_id in self.workers.forget_dead(now, self.config.missed_heartbeats):
            log.info("worker %s is gone", worker_id)
            self.index.forget(worker_id)
        cached = (
            self.index.overlap(list(req.block_hashes))
            if req.hash_version in ("", HASH_SPEC_VERSION)
            else {}
        )
        request = RouteInput(req.request_id, req.model, req.num_prompt_tokens, cached)
        result = choose(
            self.workers.workers, request, now, facilities=self.facilities(), config=self.config
        )
        if isinstance(result, pb.RouteError):
            log.info("route %s: %s", req.request_id, result.message)
            return pb.RouteReply(error=result)
        self.workers.placed(result.prefill_worker_id)
        if result.disaggregated:
            self.workers.placed(result.decode_worker_id)
        log.debug(
            "route %s -> %s/%s (%s)",
            req.request_id,
            result.prefill_worker_id,
            result.decode_worker_id,
            result.reason,
        )
        return pb.RouteReply(placement=result)
