"""The facilities handler: readings and heartbeats in, per-rack state out.

simulator tick ──> ty.facilities.readings.<rack> <── external exporters
                              │
                   on_reading: store, evaluate ──> state event (SQL) + RackState (NATS)
tick: staleness check, RackState heartbeat every state_heartbeat_s
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from nats.aio.msg import Msg

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.bus.senders import subscribe_heartbeats
from tokenyard.facilities import policy
from tokenyard.facilities.inventory import Inventory, RackSpec
from tokenyard.facilities.messages import STATE_TO_PROTO, reading_from_proto, reading_to_proto
from tokenyard.facilities.simulator import Faults, RackSimulator, SimSettings, utilization
from tokenyard.fleet import FleetView
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.facilities.store import FacilitiesStore, to_datetime
from tokenyard.v1.facilities_pb2 import FacilityReading, RackState
from tokenyard.v1.serving_pb2 import WorkerHeartbeat

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 3600.0
# The reason of an operator's drain starts so; a restart resumes the drain from it.
OPERATOR_DRAIN = "drained by an operator: "


@dataclass
class RackRuntime:
    spec: RackSpec
    base_limits: policy.RackLimits
    status: policy.RackStatus
    sim: RackSimulator | None
    faults: Faults = field(default_factory=Faults)
    latest: policy.Reading | None = None
    latest_id: int | None = None
    last_published: float = 0.0
    operator_drain: str = ""  # why an operator drained it; "" = the readings decide

    @property
    def limits(self) -> policy.RackLimits:
        cap = self.faults.power_cap_kw
        return self.base_limits if cap is None else replace(self.base_limits, power_cap_kw=cap)


class RackMonitor:
    def __init__(
        self,
        inventory: Inventory,
        store: FacilitiesStore,
        bus: Bus,
        settings: FacilitiesSettings,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.inventory = inventory
        self.store = store
        self.bus = bus
        self.settings = settings
        self.clock = clock
        self.policy = policy.PolicySettings(
            dwell_s=settings.dwell_s,
            stale_after_s=settings.stale_after_s,
            derate_seq_fraction=settings.derate_seq_fraction,
        )
        self.sim_settings = SimSettings(
            time_constant_s=settings.sim_time_constant_s,
            full_tokens_per_s=settings.sim_full_tokens_per_s,
        )
        self.started = clock()
        self.racks = {spec.name: self._runtime(spec) for spec in inventory.racks}
        self.worker_rack = inventory.worker_racks()
        self.fleet = FleetView()  # the workers' heartbeats, on this monitor's clock
        self._lock = asyncio.Lock()
        self._last_prune = 0.0

    def _runtime(self, spec: RackSpec) -> RackRuntime:
        loop = self.inventory.loop_of(spec)
        limits = policy.RackLimits(
            power_cap_kw=spec.power_cap_kw,
            supply_limit_c=loop.supply_limit_c if loop else None,
            return_limit_c=loop.return_limit_c if loop else None,
            min_flow_lpm=loop.min_flow_lpm if loop else None,
        )
        simulated = self.settings.simulate and spec.source == "simulator"
        sim = RackSimulator(spec, loop, self.sim_settings, self.started) if simulated else None
        return RackRuntime(spec, limits, policy.initial_status(self.started), sim)

    async def start(self) -> None:
        """Resume each rack's last recorded state, then listen."""
        for name, stored in (await asyncio.to_thread(self.store.last_states)).items():
            if name in self.racks:
                rt = self.racks[name]
                rt.status = policy.RackStatus(stored.state, stored.since, stored.reason)
                if stored.reason.startswith(OPERATOR_DRAIN):
                    rt.operator_drain = stored.reason.removeprefix(OPERATOR_DRAIN)
        await self.bus.subscribe(subjects.FACILITIES_READINGS_ALL, FacilityReading, self.on_reading)
        await subscribe_heartbeats(self.bus, self.on_heartbeat)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.tick(self.clock())
            except Exception:
                # NOTE: a failed tick (database hiccup) must not end the monitor; the next one retries.
                log.exception("facilities tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.tick_s)

    # --- inputs ------------------------------------------------------------------------

    async def on_heartbeat(self, hb: WorkerHeartbeat, _msg: Msg) -> None:
        self.fleet.on_heartbeat(hb, self.clock())

    async def on_reading(self, msg: FacilityReading, raw: Msg) -> None:
        rack = raw.subject.rsplit(".", 1)[-1]
        rt = self.racks.get(rack)
        if rt is None or msg.rack != rack:
            log.warning("dropping a reading for rack %r on %s", msg.rack, raw.subject)
            return
        if rt.faults.dead_sensor:
            return  # an injected dead sensor: as if nothing arrived
        reading = reading_from_proto(msg)
        reading_id = await asyncio.to_thread(self.store.add_reading, reading)
        if rt.latest is None or reading.ts >= rt.latest.ts:
            rt.latest, rt.latest_id = reading, reading_id
        await self.evaluate(rt, self.clock())

    # --- state -------------------------------------------------------------------------

    async def evaluate(self, rt: RackRuntime, now: float, *, operator: bool = False) -> None:
        """The rack's next state. `operator`: an operator just drained or undrained it; an
        undrain lets the readings decide afresh, without the drain's hysteresis."""
        if not operator and rt.latest is None and now - self.started <= self.policy.stale_after_s:
            return  # just started: readings have not had time to arrive
        async with self._lock:
            prev = rt.status
            undrained = operator and not rt.operator_drain
            base = policy.initial_status(now) if undrained else prev
            rt.status = policy.evaluate(rt.latest, rt.limits, base, now, self.policy)
            if rt.operator_drain:
                since = prev.since if prev.state is policy.State.DRAIN else now
                reason = OPERATOR_DRAIN + rt.operator_drain
                rt.status = policy.RackStatus(policy.State.DRAIN, since, reason)
            if rt.status.state == prev.state and not (operator and rt.status.reason != prev.reason):
                return
            cap = self.seq_cap(rt)
            log.warning(
                "rack %s: %s -> %s (%s)",
                rt.spec.name,
                prev.state.label,
                rt.status.state.label,
                rt.status.reason,
            )
            await asyncio.to_thread(
                self.store.add_event,
                rt.spec.name,
                now,
                prev.state,
                rt.status.state,
                rt.status.reason,
                cap,
                rt.latest_id,
            )
            await self.publish_state(rt, now)

    def seq_cap(self, rt: RackRuntime) -> int:
        """The per-worker sequence cap to publish; 0 means none new (drain) or no cap (normal)."""
        if rt.status.state is policy.State.NORMAL:
            return 0
        seen = [self.fleet.get(w) for w in rt.spec.worker_ids]
        announced = [w.heartbeat.max_num_seqs for w in seen if w is not None]
        max_num_seqs = max(
            [n for n in announced if n > 0], default=self.settings.default_max_num_seqs
        )
        return policy.seq_cap(rt.status.state, max_num_seqs, self.policy, rt.status.caps_seqs)

    def state_message(self, rt: RackRuntime, now: float) -> RackState:
        fraction = {
            policy.State.NORMAL: 1.0,
            policy.State.DERATE: self.policy.derate_seq_fraction if rt.status.caps_seqs else 1.0,
            policy.State.DRAIN: 0.0,
        }
        return RackState(
            rack=rt.spec.name,
            state=STATE_TO_PROTO[rt.status.state],
            reason=rt.status.reason,
            since_unix_s=rt.status.since,
            max_seqs_per_worker=self.seq_cap(rt),
            worker_ids=rt.spec.worker_ids,
            sent_unix_s=now,
            heartbeat_s=self.settings.state_heartbeat_s,
            seq_fraction=fraction[rt.status.state],
            power_pressure=policy.power_pressure(rt.latest, rt.limits, self.policy),
        )

    async def publish_state(self, rt: RackRuntime, now: float) -> None:
        await self.bus.publish(subjects.facilities_state(rt.spec.name), self.state_message(rt, now))
        rt.last_published = now

    # --- the periodic step -------------------------------------------------------------

    async def tick(self, now: float) -> None:
        utils = self._utilizations(now)
        for rt in self.racks.values():
            if rt.sim is not None and not rt.faults.dead_sensor:
                reading = rt.sim.step(now, utils, rt.faults)
                await self.bus.publish(
                    subjects.facilities_readings(rt.spec.name), reading_to_proto(reading)
                )
        for rt in self.racks.values():
            await self.evaluate(rt, now)  # staleness: a rack whose readings stopped
            if now - rt.last_published >= self.settings.state_heartbeat_s:
                await self.publish_state(rt, now)
        if now - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = now
            cutoff = to_datetime(now - self.settings.readings_retention_h * 3600)
            pruned = await asyncio.to_thread(self.store.prune_readings, cutoff)
            log.info("pruned %d readings older than %s", pruned, cutoff.isoformat())

    def _utilizations(self, now: float) -> dict[str, float]:
        """Per live worker, how busy it is; a dead worker draws idle power only."""
        full = self.sim_settings.full_tokens_per_s
        return {w.worker_id: utilization(w.heartbeat, full) for w in self.fleet.live(now)}

    # --- fault injection (admin API) ---------------------------------------------------

    def inject(self, rack: str, kind: str, power_cap_kw: float | None = None) -> Faults:
        faults = self.racks[rack].faults
        if kind == "pump_failure":
            faults.pump_failure = True
        elif kind == "chiller_failure":
            faults.chiller_failure = True
        elif kind == "power_cap":
            if power_cap_kw is None or power_cap_kw <= 0:
                raise ValueError("power_cap needs a positive power_cap_kw")
            faults.power_cap_kw = power_cap_kw
        elif kind == "dead_sensor":
            faults.dead_sensor = True
        else:
            raise ValueError(f"unknown fault {kind!r}")
        log.warning("rack %s: fault injected: %s", rack, kind)
        return faults

    def clear(self, rack: str) -> None:
        self.racks[rack].faults = Faults()
        log.warning("rack %s: faults cleared", rack)

    # --- operator drain (control API) --------------------------------------------------

    async def drain(self, rack: str, reason: str) -> None:
        """Drain the rack whatever its readings say, until undrain()."""
        rt = self.racks[rack]
        rt.operator_drain = reason or "no reason given"
        await self.evaluate(rt, self.clock(), operator=True)

    async def undrain(self, rack: str) -> None:
        """Lift an operator's drain: the readings decide the state again, at once."""
        rt = self.racks[rack]
        if rt.operator_drain:
            rt.operator_drain = ""
            await self.evaluate(rt, self.clock(), operator=True)
