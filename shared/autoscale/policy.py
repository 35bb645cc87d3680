"""The autoscaler's decision, as one pure function: `decide(signals, state, settings)`.

Every interval the caller (the fleet simulator, `tokenyard up --autoscale`) gathers what the
fleet says about itself into `Signals` and gets back a `Decision`: which roles to start on
which racks, and which workers to drain. The caller starts and drains; a drained worker
takes nothing new, finishes what it holds, and only then stops (no request is lost).

Sizing, the same in both modes:

    demand(role)  = its workers' summed busy share (decode: running sequences / max_num_seqs;
                    prefill: the share of time spent prefilling) + its queue / max_num_seqs
    up    when demand / workers > `high` (or the role's latency p99 misses its SLO, or the
                    queue per worker passes `queue_per_worker`): to ceil(demand / target)
    down  when demand / workers < `low` for `down_after_s` and no scale event of that role
                    for `down_cooldown_s`: by at most `max_down_share` of the pool

Workers still starting count as capacity, so a slow start is not answered with more starts.

Where, the one difference between the modes:

- `sla` ignores the racks: a new worker takes the first free node in inventory order, and
  the least busy workers drain first;
- `power` budgets each rack: a rack's committed power (the fixed draw of its running nodes
  plus every worker at its role's full-load draw) stays within `rack_budget` of its cap.
  A new worker goes to the rack with the most budget left; scaling down drains from the
  rack with the least. A start no rack has budget for is not made (`Decision.blocked`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["sla", "power"]
MODES: tuple[Mode, ...] = ("sla", "power")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class WorkerSignal:
    worker_id: str
    role: str  # prefill | decode
    rack: str
    busy: float  # 0-1: decode: running / max_num_seqs; prefill: share of time prefilling
    queued: int  # requests waiting on it
    max_num_seqs: int
    starting: bool = False  # started, not yet serving
    draining: bool = False


@dataclass(frozen=True)
class RackSignal:
    rack: str
    cap_kw: float
    power_kw: float  # the latest reading
    free_nodes: tuple[str, ...]  # nodes where a worker can start, in inventory order


@dataclass(frozen=True)
class Signals:
    now: float
    workers: tuple[WorkerSignal, ...]
    racks: tuple[RackSignal, ...]
    ttft_p99_s: float | None = None  # over the last interval's first tokens; None: no data
    itl_p99_s: float | None = None


@dataclass(frozen=True)
class AutoscaleSettings:
    mode: Mode = "power"
    ttft_p99_s: float = 2.0
    itl_p99_s: float = 0.1
    target: float = 0.6  # busy share a scaled pool aims at
    high: float = 0.75  # above: scale up
    low: float = 0.4  # below (for down_after_s): scale down
    queue_per_worker: float = 1.0  # queued requests per worker that count as a miss
    down_after_s: float = 20.0
    down_cooldown_s: float = 30.0  # after any scale event of the role
    max_down_share: float = 0.1  # of a pool drained in one decision (at least one worker)
    min_workers: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    max_workers: dict[str, int] = field(default_factory=lambda: {"prefill": 10**6, "decode": 10**6})
    # power mode: a worker's draw at full load by role (a decode step draws less than a
    # prefill) and its node's fixed draw while on, in kW
    worker_full_kw: dict[str, float] = field(
        default_factory=lambda: {"prefill": 1.0, "decode": 1.0}
    )
    node_fixed_kw: float = 0.0

    def draw_kw(self, role: str) -> float:
        """What one more worker of `role` commits of its rack's budget."""
        return self.worker_full_kw[role] + self.node_fixed_kw

    rack_budget: float = 0.95  # of a rack's cap (the facilities' power derate threshold)


@dataclass
class ScalerState:
    """What the autoscaler remembers between decisions."""

    last_event: dict[str, float] = field(default_factory=lambda: {r: -math.inf for r in ROLES})
    low_since: dict[str, float | None] = field(default_factory=lambda: {r: None for r in ROLES})


@dataclass(frozen=True)
class Start:
    role: str
    rack: str
    node: str


@dataclass(frozen=True)
class Decision:
    desired: dict[str, int]  # workers per role after this decision (draining ones not counted)
    start: tuple[Start, ...] = ()
    drain: tuple[str, ...] = ()  # worker ids
    blocked: int = 0  # starts wanted that no rack had power budget for
    reasons: tuple[str, ...] = ()


def decide(signals: Signals, state: ScalerState, s: AutoscaleSettings) -> Decision:
    """The whole policy: size each pool, then place its starts or pick its drains."""
    desired: dict[str, int] = {}
    reasons: list[str] = []
    grow: list[str] = []
    shrink: dict[str, int] = {}
    for role in ROLES:
        pool = [w for w in signals.workers if w.role == role and not w.draining]
        want, why = size_pool(role, pool, signals, state, s)
        desired[role] = want
        if why:
            reasons.append(why)
        if want > len(pool):
            grow += [role] * (want - len(pool))
            state.last_event[role] = signals.now
        elif want < len(pool):
            shrink[role] = len(pool) - want
            state.last_event[role] = signals.now
            state.low_since[role] = None
    starts, blocked = place(grow, signals, s)
    drains = tuple(d for role, n in shrink.items() for d in pick_drains(role, n, signals, s))
    for role in ROLES:  # what will run: the starts that found room
        desired[role] -= sum(1 for r in grow if r == role) - sum(
            1 for x in starts if x.role == role
        )
    return Decision(desired, tuple(starts), drains, blocked, tuple(reasons))


def size_pool(
    role: str, pool: list[WorkerSignal], signals: Signals, state: ScalerState, s: AutoscaleSettings
) -> tuple[int, str]:
    """How many workers of `role` should run (starting ones included), and why it changed."""
    n = len(pool)
    lo, hi = s.min_workers.get(role, 1), s.max_workers.get(role, 10**6)
    if n < lo:
        return lo, f"{role}: below the minimum ({n} < {lo})"
    seqs = max(1, max((w.max_num_seqs for w in pool), default=1))
    queued = sum(w.queued for w in pool)
    demand = sum(w.busy for w in pool) + queued / seqs
    serving = [w for w in pool if not w.starting] or pool
    share = demand / max(1, n)
    slo_missed = _slo_missed(role, signals, s)
    queue_long = queued > s.queue_per_worker * len(serving)
    if share > s.high or (slo_missed or queue_long) and not any(w.starting for w in pool):
        want = max(math.ceil(demand / s.target), n + 1 if slo_missed or queue_long else n)
        want = min(hi, want)
        if want > n:
            cause = "SLO missed" if slo_missed else "queue" if queue_long else f"busy {share:.2f}"
            return want, f"{role}: up {n} -> {want} ({cause})"
        return n, ""
    if share >= s.low or slo_missed or queue_long:
        state.low_since[role] = None
        return n, ""
    since = state.low_since[role]
    if since is None:
        state.low_since[role] = signals.now
        return n, ""
    cooled = signals.now - state.last_event[role] >= s.down_cooldown_s
    if signals.now - since < s.down_after_s or not cooled or n <= lo:
        return n, ""
    step = max(1, int(n * s.max_down_share))
    want = max(lo, math.ceil(demand / s.target), n - step)
    return (want, f"{role}: down {n} -> {want} (busy {share:.2f})") if want < n else (n, "")


def _slo_missed(role: str, signals: Signals, s: AutoscaleSettings) -> bool:
    """TTFT belongs to prefill, ITL to decode."""
    if role == "prefill":
        return signals.ttft_p99_s is not None and signals.ttft_p99_s > s.ttft_p99_s
    return signals.itl_p99_s is not None and signals.itl_p99_s > s.itl_p99_s


def place(grow: list[str], signals: Signals, s: AutoscaleSettings) -> tuple[list[Start], int]:
    """A node for each start; in power mode only where the rack's budget holds it."""
    free = {r.rack: list(r.free_nodes) for r in signals.racks}
    committed = {r.rack: committed_kw(r.rack, signals, s) for r in signals.racks}
    caps = {r.rack: r.cap_kw for r in signals.racks}
    starts: list[Start] = []
    blocked = 0
    for role in _interleave(grow):
        if s.mode == "sla":
            rack = next((r.rack for r in signals.racks if free[r.rack]), None)
        else:
            room = {
                r: s.rack_budget * caps[r] - committed[r] - s.draw_kw(role) for r in free if free[r]
            }
            fits = [r for r, left in room.items() if left >= 0]
            rack = max(fits, key=lambda r: (room[r] / caps[r], r)) if fits else None
        if rack is None:
            blocked += 1
            continue
        starts.append(Start(role, rack, free[rack].pop(0)))
        committed[rack] += s.draw_kw(role)
    return starts, blocked


def _interleave(roles: list[str]) -> list[str]:
    """Prefill and decode starts alternate, so a short budget is shared between them."""
    by = {r: [x for x in roles if x == r] for r in ROLES}
    out: list[str] = []
    while by["prefill"] or by["decode"]:
        for r in ROLES:
            if by[r]:
                out.append(by[r].pop())
    return out


def committed_kw(rack: str, signals: Signals, s: AutoscaleSettings) -> float:
    """A rack's power if every worker on it (draining ones too) ran at full load."""
    return sum(s.draw_kw(w.role) for w in signals.workers if w.rack == rack)


def pick_drains(role: str, n: int, signals: Signals, s: AutoscaleSettings) -> list[str]:
    """The `n` workers of `role` to drain: the least busy; in power mode from the racks
    with the least budget left first."""
    pool = [w for w in signals.workers if w.role == role and not w.draining and not w.starting]
    if s.mode == "power":
        caps = {r.rack: r.cap_kw for r in signals.racks}
        left = {r: caps[r] - committed_kw(r, signals, s) for r in caps}
        pool.sort(
            key=lambda w: (left.get(w.rack, 0.0) / caps.get(w.rack, 1.0), w.busy, w.worker_id)
        )
    else:
        pool.sort(key=lambda w: (w.busy + w.queued, w.worker_id))
    return [w.worker_id for w in pool[:n]]
