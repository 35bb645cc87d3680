"""The router's own LoRA loads: a busy adapter copied to a worker with room.

routing.lora_placement decides (a pure function); this sends the load on the path the
gateway's admin API uses (ty.lora.<worker>, services/worker/lora.py) and, once the worker
confirms, marks the adapter held in the router's fleet view before its next heartbeat says
so. One load per adapter is in flight at a time; a worker that refused one (no room after
all, a path it cannot read) is not asked for that adapter again for REFUSED_FOR_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.facilities.tracker import WorkerThrottle
from tokenyard.fleet import FleetView
from tokenyard.routing.lora_placement import LoadPlan, load_target
from tokenyard.routing.policy import PolicyConfig, RouteInput
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 60.0  # reading a large adapter from disk; the gateway's admin API waits as long
REFUSED_FOR_S = 60.0


class LoRALoads:
    def __init__(
        self, bus: Bus, fleet: FleetView, config: PolicyConfig, clock: Callable[[], float]
    ) -> None:
        self.bus = bus
        self.fleet = fleet
        self.config = config
        self.clock = clock
        self._loading: dict[str, asyncio.Task[None]] = {}  # adapter -> its load in flight
        self._refused: dict[tuple[str, str], float] = {}  # (worker, adapter) -> until when
        self.loaded = 0  # loads the workers confirmed (tests and logs read it)

    def consider(self, request: RouteInput, facilities: Mapping[str, WorkerThrottle]) -> None:
        """Start a load of ``request.lora`` if its holders are all busy and a worker has room."""
        if not request.lora or request.lora in self._loading:
            return
        now = self.clock()
        plan = load_target(
            self.fleet.workers, request, now, facilities=facilities, config=self.config
        )
        if plan is None or self._refused.get((plan.worker_id, plan.lora), 0.0) > now:
            return
        task = asyncio.get_running_loop().create_task(self._load(plan))
        self._loading[plan.lora] = task
        task.add_done_callback(lambda _: self._loading.pop(plan.lora, None))

    async def _load(self, plan: LoadPlan) -> None:
        log.info(
            "every holder of LoRA adapter %r is busy: loading it on %s", plan.lora, plan.worker_id
        )
        request = pb.LoRAAdapterRequest(
            action=pb.LoRAAdapterRequest.LOAD, lora_name=plan.lora, lora_path=plan.path
        )
        try:
            reply = await self.bus.request(
                subjects.lora(plan.worker_id), request, pb.LoRAAdapterReply, timeout=LOAD_TIMEOUT_S
            )
        except Exception as exc:  # gone or silent: its heartbeats will say which
            self._refuse(plan, f"no answer ({type(exc).__name__})")
            return
        if not reply.ok:
            self._refuse(plan, f"{reply.status}: {reply.message}")
            return
        self.fleet.note_adapter(plan.worker_id, plan.lora, held=True)
        self.loaded += 1
        log.info("%s: %s", plan.worker_id, reply.message)

    def _refuse(self, plan: LoadPlan, why: str) -> None:
        log.warning("loading LoRA adapter %r on %s failed: %s", plan.lora, plan.worker_id, why)
        self._refused[(plan.worker_id, plan.lora)] = self.clock() + REFUSED_FOR_S

    async def close(self) -> None:
        """Stop the loads in flight (a worker that already loaded keeps the adapter)."""
        tasks = list(self._loading.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
