"""The simulated fleet: replicas on racks, each an engine whose steps take the planner's time.

A replica is one worker (its `tp x pp` accelerators together). It runs the same loop as our
engine: every step decodes one token for each running sequence and prefills up to
`chunk_tokens` of the oldest waiting prompt (chunked prefill); a step takes the roofline's
time for that mix, stretched by its rack's power capping. Running sequences share a token
clock: a sequence admitted at clock v with n tokens to go finishes when the clock reaches
v + n, so a step costs O(log n) however large the batch.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from tokenyard.facilities.inventory import CoolantLoopSpec, Inventory, NodeSpec, RackSpec
from tokenyard.planner.plan import coolant_flow_lpm
from tokenyard.planner.roofline import Deployment
from tokenyard.sim.workload import SimRequest
from tokenyard.v1 import serving_pb2 as pb


@dataclass
class Live:
    """One request on its way through the fleet."""

    req: SimRequest
    prefill_worker: str = ""
    decode_worker: str = ""
    cached: int = 0  # prompt tokens found in the prefill worker's cache
    prefilled: int = 0
    routed_s: float = 0.0
    first_token_s: float = -1.0
    done_s: float = -1.0
    attempts: int = 0


@dataclass
class SimWorker:
    worker_id: str
    role: str  # prefill | decode | both
    rack: str
    dep: Deployment
    model: str
    max_num_seqs: int
    kv_tokens: int
    block_size: int = 16
    chunk_tokens: int = 2048
    cache_share: float = 0.5  # of the KV pool, kept for finished prefixes (LRU)
    waiting: deque[Live] = field(default_factory=deque)  # prompts to prefill, oldest first
    admitting: deque[Live] = field(default_factory=deque)  # handed-off sequences to decode
    clock: int = 0  # decode steps taken
    finishing: list[tuple[int, int, Live]] = field(default_factory=list)  # (clock, rid, live)
    context_sum: float = 0.0  # the running sequences' lengths at clock `context_at`
    context_at: int = 0
    kv_used: int = 0  # tokens reserved by admitted sequences
    cache: OrderedDict[str, int] = field(default_factory=OrderedDict)  # key -> tokens
    busy: bool = False
    busy_s: float = 0.0  # stepping time since the last heartbeat
    batch_s: float = 0.0  # stepping time x batch occupancy, for the power model
    prefill_s: float = 0.0  # stepping time spent prefilling
    tokens: int = 0  # tokens produced since the last heartbeat
    slowdown: float = 1.0  # > 1 while the rack's power is capped
    seq_cap: int = 0  # from the facilities derate (what the worker itself would announce)
    # off -> starting -> on -> draining -> off, under an autoscaler; always "on" without one
    power: str = "on"
    ready_s: float = 0.0  # when a starting worker begins to serve
    busy_share: float = 0.0  # the last heartbeat interval's load, for the autoscaler
    # The server's fixed draw as a share of `gpu_tdp_w`, drawn through the worker while its
    # node is on; 0 where the rack's idle power carries it (a fleet that is always on).
    fixed_share: float = 0.0
    inbound: int = 0  # sequences placed on it for decoding, still on their way from prefill

    @property
    def running(self) -> int:
        return len(self.finishing)

    def context_mean(self) -> float:
        if not self.finishing:
            return 0.0
        grown = self.context_sum + (self.clock - self.context_at) * len(self.finishing)
        return grown / len(self.finishing)

    def heartbeat(self, interval_ms: int) -> pb.WorkerHeartbeat:
        blocks = max(1, self.kv_tokens // self.block_size)
        used = min(blocks, self.kv_used // self.block_size)
        return pb.WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.role,
            model=self.model,
            num_running=self.running + (1 if self.waiting and self.waiting[0].prefilled else 0),
            num_waiting=len(self.waiting) + len(self.admitting),
            num_free_blocks=blocks - used,
            num_blocks=blocks,
            max_num_seqs=self.max_num_seqs,
            block_size=self.block_size,
            heartbeat_interval_ms=interval_ms,
            seq_cap=self.seq_cap,
            draining=self.power == "draining",
        )

    @property
    def empty(self) -> bool:
        """Nothing running, queued or being handed over: a draining worker may stop."""
        return not (self.finishing or self.waiting or self.admitting or self.busy or self.inbound)

    # --- prefix cache ------------------------------------------------------------------

    def cached_tokens(self, key: str) -> int:
        return self.cache.get(key, 0) if key else 0

    def remember(self, key: str, tokens: int) -> str | None:
        """Keep `key`; returns the key evicted to make room, if any."""
        if not key:
            return None
        self.cache[key] = tokens
        self.cache.move_to_end(key)
        limit = self.kv_tokens * self.cache_share
        evicted = None
        while sum(self.cache.values()) > limit and len(self.cache) > 1:
            evicted, _ = self.cache.popitem(last=False)
        return evicted

    # --- decode bookkeeping ------------------------------------------------------------

    def start_decoding(self, live: Live, remaining: int) -> None:
        self._sync_context()
        self.context_sum += live.req.prompt_len + (live.req.output_len - remaining)
        heapq.heappush(self.finishing, (self.clock + remaining, live.req.rid, live))

    def pop_finished(self) -> list[Live]:
        self._sync_context()
        done = []
        while self.finishing and self.finishing[0][0] <= self.clock:
            _, _, live = heapq.heappop(self.finishing)
            self.context_sum -= live.req.prompt_len + live.req.output_len
            self.kv_used -= live.req.prompt_len + live.req.output_len
            done.append(live)
        return done

    def _sync_context(self) -> None:
        self.context_sum += (self.clock - self.context_at) * len(self.finishing)
        self.context_at = self.clock


@dataclass(frozen=True)
class FleetSpec:
    prefill_replicas: int
    decode_replicas: int
    both_replicas: int = 0
    max_num_seqs: int = 256
    racks_power_oversubscription: float = 0.85  # rack cap / the nameplate of its nodes
    # Racks are not all alike (feeds, cooling, age): caps spread down to this share below
    # the oversubscribed cap, evenly over the racks, in a fixed shuffled order.
    rack_cap_spread: float = 0.15
    server_fixed_share: float = 0.3  # of a server's non-accelerator power, drawn even when idle
    seed: int = 0
    coolant_delta_t_c: float = 10.0
    # Nodes with no role yet (`slot-<i>`): an autoscaler gives each its role when it starts.
    slots: int = 0


def build_fleet(dep: Deployment, spec: FleetSpec, model: str) -> tuple[list[SimWorker], Inventory]:
    """Workers interleaved by role across racks, and the racks' facilities inventory.

    Each worker is one inventory node holding its `tp x pp` accelerators; racks take as many
    as their GPUs allow (`nodes_per_rack x per_node`). A rack's non-accelerator power (CPUs,
    NICs, fans) is its servers' nameplate minus their accelerators' TDP, always drawn.
    """
    hw = dep.hw
    roles = (
        ["prefill"] * spec.prefill_replicas
        + ["decode"] * spec.decode_replicas
        + ["both"] * spec.both_replicas
        + ["slot"] * spec.slots
    )
    # Interleave roles evenly so every rack holds the fleet's mix, as a scheduler spreading
    # pods would: the k-th of a role's n workers goes at (k + 0.5) / n along the racks.
    counts = {role: roles.count(role) for role in set(roles)}
    firsts = {role: roles.index(role) for role in counts}
    order = sorted(
        range(len(roles)),
        key=lambda i: ((i - firsts[roles[i]] + 0.5) / counts[roles[i]], i),
    )
    kv = dep.kv_capacity_tokens()
    workers = [
        SimWorker(f"{roles[i]}-{i}", roles[i], "", dep, model, spec.max_num_seqs, kv) for i in order
    ]
    rack_gpus = max(hw.nodes_per_rack * hw.per_node, dep.gpus)
    per_rack = max(1, rack_gpus // dep.gpus)
    other_kw_per_gpu = max(0.0, hw.node_kw - hw.per_node * hw.tdp_w / 1000) / hw.per_node
    # The servers' other parts (CPUs, memory, NICs, fans): a fixed share always drawn, the
    # rest following the accelerators' load, so it rides on each accelerator's power.
    fixed_kw_per_gpu = spec.server_fixed_share * other_kw_per_gpu
    gpu_w = hw.tdp_w + 1000 * (other_kw_per_gpu - fixed_kw_per_gpu)
    loops: list[CoolantLoopSpec] = []
    racks: list[RackSpec] = []
    count = -(-len(workers) // per_rack)
    spread = [1.0 - spec.rack_cap_spread * i / max(1, count - 1) for i in range(count)]
    random.Random(spec.seed).shuffle(spread)
    # NOTE: an autoscaled fleet switches nodes off, and an off node draws nothing: its fixed
    # draw goes with its worker, not into the rack's idle power.
    switched = spec.slots > 0
    for w in workers:
        w.fixed_share = 1000 * fixed_kw_per_gpu / gpu_w if switched else 0.0
        w.power = "off" if w.role == "slot" else "on"
    for r in range(0, len(workers), per_rack):
        members = workers[r : r + per_rack]
        gpus = len(members) * dep.gpus
        nameplate = gpus * (hw.tdp_w / 1000 + other_kw_per_gpu)
        name = f"rack{r // per_rack}"
        flow = coolant_flow_lpm(nameplate, spec.coolant_delta_t_c)
        loops.append(
            CoolantLoopSpec(name=f"{name}-loop", min_flow_lpm=0.6 * flow, nominal_flow_lpm=flow)
        )
        racks.append(
            RackSpec(
                name=name,
                loop=f"{name}-loop",
                cooling="liquid",
                power_cap_kw=nameplate * spec.racks_power_oversubscription * spread[r // per_rack],
                idle_power_kw=0.0 if switched else gpus * fixed_kw_per_gpu,
                nodes=[
                    NodeSpec(name=f"node-{w.worker_id}", gpus=dep.gpus, gpu_tdp_w=gpu_w,
                             workers=[w.worker_id])
                    for w in members
                ],
            )
        )  # fmt: skip
        for w in members:
            w.rack = name
    return workers, Inventory(site="sim", coolant_loops=loops, racks=racks)
