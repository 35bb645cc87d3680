"""A discrete-event simulation of a serving fleet, placed by the router's own policy.

    workers, inventory = build_fleet(dep, FleetSpec(prefill_replicas=8, decode_replicas=24), model)
    result = Simulation(workers, inventory, generate(WorkloadSpec(...)), SimConfig()).run()

What is real here: the router's `routing.policy.choose` places every request from a
`FleetView` fed by heartbeats once per interval (plus the router's own pending placements, exactly as
the router keeps them); `facilities.policy.evaluate` turns each rack's reading into its
state; `RackStateTracker` turns states into the router's per-worker throttles; and
`facilities.simulator` turns worker activity into rack power and coolant temperatures.
What is modelled: each replica's step time (the planner's roofline), the power a busy
accelerator draws, and power capping (a rack drawing more than its cap runs slower, in
proportion, until the next reading).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenyard.facilities import policy as fpolicy
from tokenyard.facilities.inventory import Inventory
from tokenyard.facilities.messages import STATE_TO_PROTO
from tokenyard.facilities.simulator import Faults, RackSimulator, SimSettings
from tokenyard.facilities.tracker import RackStateTracker, WorkerThrottle
from tokenyard.fleet import FleetView
from tokenyard.routing.policy import PolicyConfig, RouteInput, choose
from tokenyard.sim.candidates import CandidateIndex
from tokenyard.sim.fleet import Live, SimWorker
from tokenyard.sim.workload import SimRequest
from tokenyard.stats import percentile
from tokenyard.v1 import serving_pb2 as pb
from tokenyard.v1.facilities_pb2 import RackState

if TYPE_CHECKING:
    from tokenyard.sim.autoscale import SimAutoscaler

POLICIES = ("round-robin", "kv-aware", "kv-aware+facilities")


@dataclass(frozen=True)
class SimConfig:
    policy: str = "kv-aware+facilities"
    heartbeat_s: float = 1.0
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1
    network_gbs: float = 50.0
    # What a request spends outside the engines before its first token reaches the client
    # (HTTP, tokenizing, routing, the work queue, the token's way back): added to its arrival.
    request_path_s: float = 0.0
    max_attempts: int = 20  # a request the router turns away is retried after Retry-After
    facilities: fpolicy.PolicySettings = field(default_factory=fpolicy.PolicySettings)
    derate_penalty: float = 0.5
    # NOTE: simulated workers announce no measured step times, which the router's cost
    # model (conditional disaggregation) needs; the simulation disaggregates every request
    # a decode worker can take, as the former fixed threshold did for its long prompts.
    router: PolicyConfig = field(default_factory=lambda: PolicyConfig(disaggregation="always"))
    # Hand `choose` only the workers it could pick (tokenyard.sim.candidates): the same
    # placements, far cheaper at fleet scale. Off: every worker, every request.
    candidate_index: bool = True
    # The share of TDP an accelerator draws: idle, and decoding a full batch; prefill draws all.
    idle_power_share: float = 0.2
    decode_power_share: float = 0.75


@dataclass
class SimResult:
    policy: str
    requests: int
    completed: int
    rejected: int
    duration_s: float
    goodput_req_s: float
    throughput_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    prefix_hit_rate: float
    throttle_events: int  # rack-intervals in which a rack drew more than its power cap
    throttled_rack_s: float
    derate_events: int  # racks entering derate or drain
    rack_peak_kw: float
    rack_peak_fraction_of_cap: float
    rack_mean_fraction_of_cap: (
        float  # over racks and readings: how close the fleet runs to its caps
    )
    # requests within both SLOs over all requests (rejected ones included)
    slo_attainment: float = 0.0
    gpu_hours: float = 0.0  # accelerators switched on (starting, serving or draining) x time
    energy_kwh: float = 0.0  # the racks' power (a capped rack draws at most its cap) x time
    route_errors: dict[str, int] = field(default_factory=dict)
    rack_tokens: dict[str, int] = field(default_factory=dict)
    power_timeline: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # under an autoscaler: (time, prefill workers, decode workers) serving or starting
    workers_timeline: list[tuple[float, int, int]] = field(default_factory=list)

    def to_json(self, timeline: bool = False) -> dict:
        hidden = ("power_timeline", "workers_timeline")
        out = {k: v for k, v in self.__dict__.items() if k not in hidden}
        if timeline:
            out["power_timeline"] = self.power_timeline
            out["workers_timeline"] = self.workers_timeline
        return out


class Simulation:
    def __init__(
        self,
        workers: list[SimWorker],
        inventory: Inventory,
        requests: list[SimRequest],
        config: SimConfig,
        autoscaler: SimAutoscaler | None = None,
    ) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r} (known: {', '.join(POLICIES)})")
        self.cfg = config
        self.workers = {w.worker_id: w for w in workers}
        self.inventory = inventory
        self.requests = requests
        self.now = 0.0
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.tracker = RackStateTracker(
            clock=lambda: self.now, derate_penalty=config.derate_penalty
        )
        self.fleet = FleetView(config.router.missed_heartbeats, racks=self.tracker)
        self.facilities_on = config.policy == "kv-aware+facilities"
        self.racks = {
            r.name: RackSimulator(r, inventory.loop_of(r), SimSettings(), 0.0)
            for r in inventory.racks
        }
        self.status = {r.name: fpolicy.initial_status(0.0) for r in inventory.racks}
        self.prefix_index: dict[str, set[str]] = {}
        self._rr = itertools.cycle([w for w in workers if w.role != "decode"])
        decoders = [w for w in workers if w.role == "decode"]
        self._rr_decode = itertools.cycle(decoders) if decoders else None
        self.done: list[Live] = []
        self.rejected = 0
        self.route_errors: dict[str, int] = {}  # by the router's error code; each was retried
        self.rack_tokens: dict[str, int] = {}  # tokens prefilled and decoded, by rack
        self.throttle_events = 0
        self.throttled_rack_s = 0.0
        self.derate_events = 0
        self.peak_kw = 0.0
        self.peak_fraction = 0.0
        self.fraction_sum, self.readings = 0.0, 0
        self.timeline: dict[str, list[tuple[float, float]]] = {r: [] for r in self.racks}
        self.outstanding = len(requests)
        self.max_num_seqs = max((w.max_num_seqs for w in workers), default=1)
        self.throttles: dict[
            str, WorkerThrottle
        ] = {}  # the router's facilities input, as of the last tick
        self.index = CandidateIndex(config.router) if config.candidate_index else None
        self.autoscaler = autoscaler
        self.energy_kwh = 0.0
        self.gpu_s = 0.0
        self.last_power: dict[str, float] = {r.name: 0.0 for r in inventory.racks}
        # first-token and inter-token times since the autoscaler last looked
        self.recent_ttft: list[float] = []
        self.recent_itl: list[float] = []

    # --- the event loop ----------------------------------------------------------------

    def at(self, t: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        for r in self.requests:
            self.at(r.arrival_s + self.cfg.request_path_s, "arrive", Live(r))
        self.tick()  # the first heartbeats, so the router knows the fleet
        while self._events and self.outstanding > 0:
            t, _, kind, payload = heapq.heappop(self._events)
            self.now = t
            if kind == "arrive":
                self.arrive(payload)  # type: ignore[arg-type]
            elif kind == "step":
                self.step_end(*payload)  # type: ignore[misc]
            elif kind == "handoff":
                self.handoff(*payload)  # type: ignore[misc]
            elif kind == "tick":
                self.tick()
        return self.result()

    # --- routing -----------------------------------------------------------------------

    def arrive(self, live: Live) -> None:
        live.attempts += 1
        req = live.req
        placement = self.route(live)
        if isinstance(placement, pb.RouteError):
            name = pb.RouteError.Code.Name(placement.code)
            self.route_errors[name] = self.route_errors.get(name, 0) + 1
            if live.attempts >= self.cfg.max_attempts:
                self.rejected += 1
                self.outstanding -= 1
            else:
                self.at(self.now + max(placement.retry_after_s, 1), "arrive", live)
            return
        prefill = self.workers[placement.prefill_worker_id]
        live.prefill_worker = prefill.worker_id
        live.decode_worker = placement.decode_worker_id or prefill.worker_id
        if live.decode_worker != prefill.worker_id:
            self.workers[live.decode_worker].inbound += 1
        live.cached = min(prefill.cached_tokens(req.prefix_key), req.prefix_len, req.prompt_len - 1)
        live.routed_s = self.now
        prefill.waiting.append(live)
        self.wake(prefill)

    def route(self, live: Live) -> pb.Placement | pb.RouteError:
        req = live.req
        if self.cfg.policy == "round-robin":
            prefill = next(self._rr)
            decode = next(self._rr_decode) if self._rr_decode else prefill
            return pb.Placement(
                prefill_worker_id=prefill.worker_id,
                decode_worker_id=decode.worker_id,
                disaggregated=decode is not prefill,
            )
        cached = {
            wid: self.workers[wid].cached_tokens(req.prefix_key) // self.workers[wid].block_size
            for wid in self.prefix_index.get(req.prefix_key, ())
        }
        request = RouteInput(str(req.rid), "", req.prompt_len, cached)
        throttles = self.throttles if self.facilities_on else None
        workers = self.fleet.workers
        if self.index is not None:
            subset = self.index.candidates(workers, cached)
            result = choose(subset, request, self.now, facilities=throttles, config=self.cfg.router)
            if isinstance(result, pb.RouteError):  # the router's own answer, from every worker
                result = choose(
                    workers, request, self.now, facilities=throttles, config=self.cfg.router
                )
        else:
            result = choose(
                workers, request, self.now, facilities=throttles, config=self.cfg.router
            )
        if isinstance(result, pb.Placement):
            self._placed(result.prefill_worker_id)
            if result.disaggregated:
                self._placed(result.decode_worker_id)
        return result

    def _placed(self, worker_id: str) -> None:
        self.fleet.placed(worker_id)
        if self.index is not None:
            self.index.update(self.fleet.workers[worker_id])

    # --- a worker's engine steps ---------------------------------------------------------

    def cap(self, w: SimWorker) -> int:
        return min(w.max_num_seqs, w.seq_cap) if w.seq_cap > 0 else w.max_num_seqs

    def wake(self, w: SimWorker) -> None:
        if not w.busy:
            self.start_step(w)

    def start_step(self, w: SimWorker) -> None:
        while w.admitting and w.running < self.cap(w) and self._room(w, w.admitting[0]):
            live = w.admitting.popleft()
            w.kv_used += live.req.prompt_len + live.req.output_len
            w.start_decoding(live, live.req.output_len - 1)
        chunk, head = 0, None
        if w.waiting:
            head = w.waiting[0]
            admitted = head.prefilled > 0
            if not admitted and w.running < self.cap(w) and self._room(w, head):
                w.kv_used += head.req.prompt_len + head.req.output_len
                admitted = True
            if admitted:
                todo = head.req.prompt_len - head.cached - head.prefilled
                chunk = max(1, min(todo, w.chunk_tokens - w.running))
            else:
                head = None
        batch = w.running
        if batch == 0 and chunk == 0:
            w.busy = False
            return
        dep = w.dep
        t = dep.decode_step_s(batch, w.context_mean()) if batch else 0.0
        if chunk:
            prefill = dep.prefill_s(chunk, head.cached + head.prefilled if head else 0)
            t += prefill - (dep.hw.step_overhead_ms * 1e-3 if batch else 0.0)
            w.prefill_s += prefill
        t *= w.slowdown
        w.busy = True
        w.busy_s += t
        occupancy = min(1.0, batch / max(1, self.cap(w)))
        w.batch_s += t * (1.0 if chunk else occupancy)
        self.at(self.now + t, "step", (w, head, chunk, batch))

    def _room(self, w: SimWorker, live: Live) -> bool:
        return w.kv_used + live.req.prompt_len + live.req.output_len <= w.kv_tokens or (
            w.running == 0 and not w.kv_used
        )

    def step_end(self, w: SimWorker, head: Live | None, chunk: int, batch: int) -> None:
        self.rack_tokens[w.rack] = self.rack_tokens.get(w.rack, 0) + batch + chunk
        if batch:
            w.clock += 1
            w.tokens += batch
            for live in w.pop_finished():
                self.finish(w, live)
        if head is not None and chunk:
            head.prefilled += chunk
            if head.cached + head.prefilled >= head.req.prompt_len:
                self.prefilled(w, head)
        self.start_step(w)

    def prefilled(self, w: SimWorker, live: Live) -> None:
        w.waiting.popleft()
        live.first_token_s = self.now
        self.recent_ttft.append(self.now - live.req.arrival_s)
        req = live.req
        self.remember(w, req.cache_key, min(req.cache_len, req.prompt_len))
        if live.decode_worker == w.worker_id:
            if req.output_len <= 1:
                w.kv_used -= req.prompt_len + req.output_len
                self.finish(w, live)
            else:
                w.start_decoding(live, req.output_len - 1)
            return
        w.kv_used -= req.prompt_len + req.output_len  # handed off
        delay = w.dep.kv_transfer_s(req.prompt_len, self.cfg.network_gbs)
        self.at(self.now + delay, "handoff", (self.workers[live.decode_worker], live))

    def handoff(self, w: SimWorker, live: Live) -> None:
        w.inbound -= 1
        if live.req.output_len <= 1:
            self.finish(w, live)
            return
        w.admitting.append(live)
        self.wake(w)

    def finish(self, w: SimWorker, live: Live) -> None:
        live.done_s = self.now
        if live.req.output_len > 1 and live.first_token_s >= 0:
            self.recent_itl.append((self.now - live.first_token_s) / (live.req.output_len - 1))
        self.done.append(live)
        self.outstanding -= 1
        if w.role != "decode":  # a worker that can prefill keeps the whole conversation
            self.remember(w, live.req.cache_key, live.req.cache_len)

    def remember(self, w: SimWorker, key: str, tokens: int) -> None:
        if not key or tokens <= 0:
            return
        evicted = w.remember(key, tokens)
        self.prefix_index.setdefault(key, set()).add(w.worker_id)
        if evicted is not None:
            self.prefix_index.get(evicted, set()).discard(w.worker_id)

    # --- heartbeats, power and the facilities policy --------------------------------------

    def tick(self) -> None:
        dt = self.cfg.heartbeat_s
        interval_ms = int(dt * 1000)
        utils: dict[str, float] = {}
        for w in self.workers.values():
            if w.power != "off":
                utils[w.worker_id] = self._beat(w, dt, interval_ms) + w.fixed_share
                self.gpu_s += w.dep.gpus * dt
        for rack in self.inventory.racks:
            reading = self.racks[rack.name].step(self.now, utils, Faults())
            self.last_power[rack.name] = reading.power_kw
            # Power capping holds a rack at its cap (and slows its work, below).
            self.energy_kwh += min(reading.power_kw, rack.power_cap_kw) * dt / 3600
            self.timeline[rack.name].append((round(self.now, 3), round(reading.power_kw, 2)))
            self.peak_kw = max(self.peak_kw, reading.power_kw)
            ratio = reading.power_kw / rack.power_cap_kw
            self.peak_fraction = max(self.peak_fraction, ratio)
            self.fraction_sum += ratio
            self.readings += 1
            slowdown = max(1.0, ratio)
            if ratio > 1.0:
                self.throttle_events += 1
                self.throttled_rack_s += dt
            loop = self.inventory.loop_of(rack)
            limits = fpolicy.RackLimits(
                rack.power_cap_kw,
                loop.supply_limit_c if loop else None,
                loop.return_limit_c if loop else None,
                loop.min_flow_lpm if loop else None,
            )
            prev = self.status[rack.name]
            status = fpolicy.evaluate(reading, limits, prev, self.now, self.cfg.facilities)
            if status.state > prev.state:
                self.derate_events += 1
            self.status[rack.name] = status
            cap = 0  # normal: no cap; drain: nothing new (the router sees the state)
            if status.state is fpolicy.State.DERATE:
                cap = fpolicy.seq_cap(
                    status.state, self.max_num_seqs, self.cfg.facilities, status.caps_seqs
                )
            pressure = fpolicy.power_pressure(reading, limits, self.cfg.facilities)
            self.tracker.apply(
                self._state_message(rack.name, rack.worker_ids, status, cap, pressure)
            )
            for wid in rack.worker_ids:
                w = self.workers[wid]
                w.slowdown = slowdown
                w.seq_cap = cap if self.facilities_on else 0
        if self.autoscaler is not None:
            self.autoscaler.tick(self)
        # Rack states change only here, so the router's view of them is built once a tick.
        self.throttles = self.tracker.by_worker()
        if self.index is not None:
            self.index.rebuild(self.fleet.workers, self.throttles if self.facilities_on else {})
        if self.outstanding > 0:
            self.at(self.now + dt, "tick")

    def _beat(self, w: SimWorker, dt: float, interval_ms: int) -> float:
        """A switched-on worker's heartbeat (none while starting); returns its accelerators'
        draw as a share of their TDP over the interval."""
        idle = self.cfg.idle_power_share
        if w.power == "starting":
            return idle
        if w.power == "draining" and w.empty:
            w.power = "off"  # drained: it stops, and the router forgets it
            self.fleet.workers.pop(w.worker_id, None)
            return idle
        self.fleet.on_heartbeat(w.heartbeat(interval_ms), self.now)
        busy = min(1.0, w.busy_s / dt)
        prefill = min(1.0, w.prefill_s / dt)
        decode = min(1.0, w.batch_s / dt) - prefill
        activity = prefill + max(0.0, decode) * self.cfg.decode_power_share
        w.busy_share = busy if w.role == "prefill" else w.running / max(1, self.cap(w))
        w.busy_s = w.batch_s = w.prefill_s = 0.0
        w.tokens = 0
        return min(1.0, idle + (1 - idle) * activity) if busy else idle

    def _state_message(
        self, rack: str, workers: list[str], status: fpolicy.RackStatus, cap: int, pressure: float
    ) -> RackState:
        return RackState(
            rack=rack,
            state=STATE_TO_PROTO[status.state],
            reason=status.reason,
            since_unix_s=status.since,
            max_seqs_per_worker=cap,
            worker_ids=workers,
            sent_unix_s=self.now,
            heartbeat_s=self.cfg.heartbeat_s,
            power_pressure=pressure,
        )

    # --- the report ----------------------------------------------------------------------

    def result(self) -> SimResult:
        done = [d for d in self.done if d.first_token_s >= 0]
        ttft = [d.first_token_s - d.req.arrival_s for d in done]
        itl = [
            (d.done_s - d.first_token_s) / (d.req.output_len - 1)
            for d in done
            if d.req.output_len > 1
        ]
        good = sum(
            1
            for d in done
            if d.first_token_s - d.req.arrival_s <= self.cfg.ttft_slo_s
            and (
                d.req.output_len <= 1
                or (d.done_s - d.first_token_s) / (d.req.output_len - 1) <= self.cfg.itl_slo_s
            )
        )
        start = min((r.arrival_s for r in self.requests), default=0.0)
        end = max((d.done_s for d in done), default=start)
        duration = max(end - start, 1e-9)
        prompt = sum(d.req.prompt_len for d in done) or 1
        timeline = self.autoscaler.timeline if self.autoscaler is not None else []
        return SimResult(
            policy=self.cfg.policy,
            requests=len(self.requests),
            completed=len(done),
            rejected=self.rejected,
            duration_s=round(duration, 6),
            goodput_req_s=round(good / duration, 3),
            throughput_tok_s=round(sum(d.req.output_len for d in done) / duration, 1),
            ttft_p50_ms=_pct_ms(ttft, 50),
            ttft_p99_ms=_pct_ms(ttft, 99),
            itl_p50_ms=_pct_ms(itl, 50),
            itl_p99_ms=_pct_ms(itl, 99),
            prefix_hit_rate=round(sum(d.cached for d in done) / prompt, 4),
            throttle_events=self.throttle_events,
            throttled_rack_s=round(self.throttled_rack_s, 1),
            derate_events=self.derate_events,
            rack_peak_kw=round(self.peak_kw, 2),
            rack_peak_fraction_of_cap=round(self.peak_fraction, 3),
            rack_mean_fraction_of_cap=round(self.fraction_sum / max(1, self.readings), 3),
            slo_attainment=round(good / max(1, len(self.requests)), 5),
            gpu_hours=round(self.gpu_s / 3600, 3),
            energy_kwh=round(self.energy_kwh, 3),
            route_errors=dict(self.route_errors),
            rack_tokens=dict(sorted(self.rack_tokens.items())),
            power_timeline=self.timeline,
            workers_timeline=timeline,
        )


def _pct_ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return round(percentile(values, q) * 1e3, 2)
