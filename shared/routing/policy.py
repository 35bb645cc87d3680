"""Placement policy: a pure function from a snapshot of the fleet to one request's placement.

``choose(workers, request, now)`` never touches NATS or a clock of its own, so tests call it
with scripted worker tables. Its inputs:

- ``workers``: the live view of every worker (from heartbeats, plus the router's own
  placements since each worker's last beat, so a burst does not herd onto one worker);
- ``request.cached_blocks``: per worker, how many leading blocks of this prompt it holds
  (from the global KV event index);
- ``request.shared_blocks``: how many leading blocks the shared KV-cache service holds.
  Any worker with a KV pool can fetch them before computing the rest, at a price: a shared
  block is worth ``pull_value`` of a local one (1 - its measured fetch time over the time
  to compute its tokens there, from the worker's heartbeat), so a worker's local hit
  beats an equal shared hit, and a longer shared hit can beat a short local one;
- ``facilities``: per worker, what the facilities service says about its rack
  (drain = place nothing new there, derate = a penalty and maybe a lower cap on
  concurrent sequences, and near the power cap a weight on the worker's load).

A prefill-capable worker (role prefill or both), or a decode worker that announces
``local_prefill`` (it runs whole requests routed to it), runs the prompt: the best by
prefix overlap and load. Whether a prefill worker also
decodes (aggregated) or hands the sequence to a decode worker (disaggregated) is a cost
model (``tokenyard.routing.cost``, conditional disaggregation): hand off only when
the decode worker's predicted inter-token latency, over the request's output, saves more
than the hand-off costs. The predictions come from each worker's measured step times,
running sequences and queued prompt tokens (heartbeats). ``PolicyConfig.disaggregation``
can force either way ("always" for tests of the hand-off path, "never").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from tokenyard.facilities.tracker import UNKNOWN, WorkerThrottle
from tokenyard.fleet import DEFAULT_MISSED_HEARTBEATS, WorkerView
from tokenyard.routing import cost
from tokenyard.v1 import serving_pb2 as pb


@dataclass(frozen=True)
class RouteInput:
    request_id: str
    model: str
    num_prompt_tokens: int
    cached_blocks: Mapping[str, int] = field(default_factory=dict)  # worker -> leading blocks held
    max_tokens: int = 0  # 0 = unknown
    turn: int = 0  # the router's count of requests so far (round-robin placement takes it)
    shared_blocks: int = 0  # leading blocks the shared KV-cache service holds
    priority: int = 0  # lower = more urgent (engine/fair_queue.py); > 0 is shed first
    lora: str = ""  # a LoRA adapter: only workers that hold it (their heartbeats say) fit


@dataclass(frozen=True)
class PolicyConfig:
    # "auto": the cost model decides per request; "always" / "never" force it.
    disaggregation: Literal["auto", "always", "never"] = "auto"
    costs: cost.CostConfig = field(default_factory=cost.CostConfig)
    missed_heartbeats: int = (
        DEFAULT_MISSED_HEARTBEATS  # a worker silent this many intervals is dead
    )
    # How many sequences may wait per worker beyond its cap before the fleet is "overloaded".
    queue_per_worker: int = 64
    # A request less urgent than normal (priority > 0) is placed only while a worker's queue
    # is under this share of queue_per_worker: an overloaded fleet sheds background work
    # first and keeps the rest of its queues for normal and urgent requests.
    low_priority_queue_share: float = 0.5
    overlap_weight: float = 1.0  # value of a fully cached prompt, in units of a full worker
    kv_weight: float = 0.5  # penalty of a full KV pool, same units
    overloaded_retry_after_s: int = 1
    # "kv-aware": prefix overlap and load decide the prompt's worker (the default);
    # "round-robin": the next worker with room in turn, whatever it holds (a baseline to
    # measure the KV-aware choice against: `tokenyard up --router-placement round-robin`).
    placement: Literal["kv-aware", "round-robin"] = "kv-aware"
    # A shared-tier block's worth, as a share of a local one, until a worker has measured
    # both its fetch and its compute cost.
    shared_hit_value: float = 0.8
    # A LoRA adapter's holders this busy (sequences over cap, as free_score counts them) or
    # more, every one: a less busy worker with room for an adapter loads it
    # (routing.lora_placement). 1.0 = when every holder's sequence slots are taken.
    lora_load_busy: float = 1.0


# A worker on no rack the facilities service knows is placed as on a normal one.
NORMAL = UNKNOWN


def choose(
    workers: Mapping[str, WorkerView],
    request: RouteInput,
    now: float,
    *,
    facilities: Mapping[str, WorkerThrottle] | None = None,
    config: PolicyConfig | None = None,
) -> pb.Placement | pb.RouteError:
    config = config or PolicyConfig()
    facilities = facilities or {}
    alive = [w for w in workers.values() if w.alive(now, config.missed_heartbeats)]
    # A worker that says it cannot take work (its consumer gone, its engine stuck) gets none,
    # and one an operator drained is alive but takes nothing new: as if it were not there.
    live = [w for w in alive if w.ready and not w.draining]
    if request.model:
        serving = [w for w in live if w.model == request.model]
        if live and not serving:
            models = sorted({w.model for w in live})
            return _error(
                pb.RouteError.UNKNOWN_MODEL,
                f"model {request.model!r} is not served (serving: {models})",
            )
        live = serving
    if request.lora:
        holding = [w for w in live if request.lora in w.heartbeat.lora_adapters]
        if live and not holding:
            return _error(
                pb.RouteError.UNKNOWN_MODEL,
                f"the LoRA adapter {request.lora!r} is loaded on no live worker",
            )
        live = holding
    # A worker's context is what its heartbeat says: one that claims a short one gets no
    # request beyond it, and the others still serve those.
    fitting = [w for w in live if fits(w, request)]
    if live and not fitting:
        longest = max(w.heartbeat.max_model_len for w in live)
        return _error(
            pb.RouteError.CONTEXT_TOO_LONG,
            f"no worker's context holds {request.num_prompt_tokens} prompt tokens and "
            f"{request.max_tokens} more (the longest is {longest} tokens)",
        )
    live = fitting
    # Local prefill on a decode worker is a whole request there: never under "always".
    local_ok = config.disaggregation != "always"
    prefill_live = [w for w in live if w.prefills or (local_ok and w.local_prefill)]
    if not prefill_live:
        if any(w.draining and w.prefills for w in alive):
            return _error(
                pb.RouteError.ALL_DRAINED,
                "every prefill worker is drained by an operator",
                config.overloaded_retry_after_s,
            )
        return _error(pb.RouteError.NO_WORKERS, "no live prefill worker")
    open_ = [w for w in prefill_live if facilities.get(w.worker_id, NORMAL).state != "drain"]
    if not open_:
        retry = max(facilities[w.worker_id].retry_after_s for w in prefill_live)
        return _error(pb.RouteError.ALL_DRAINED, "every prefill worker's rack is drained", retry)
    prefill = (
        _next_in_turn(open_, request.turn, facilities, config, request.priority)
        if config.placement == "round-robin"
        else _best(open_, request, facilities, config)
    )
    if prefill is None:
        return _error(
            pb.RouteError.OVERLOADED,
            "every prefill worker is at its cap",
            config.overloaded_retry_after_s,
        )
    return _place(prefill, live, request, facilities, config)


def _place(
    prefill: WorkerView,
    live: list[WorkerView],
    request: RouteInput,
    facilities: Mapping[str, WorkerThrottle],
    config: PolicyConfig,
) -> pb.Placement:
    cached = _hit_tokens(prefill, request, config)[1]

    def aggregated(reason: str) -> pb.Placement:
        return pb.Placement(
            prefill_worker_id=prefill.worker_id,
            decode_worker_id=prefill.worker_id,
            disaggregated=False,
            reason=reason,
            expected_cached_tokens=cached,
        )

    if config.disaggregation == "never":
        return aggregated("disaggregation is off")
    if not prefill.prefills:  # a decode worker's local prefill: it has no KV to hand out
        return aggregated("a decode worker runs the whole request")
    decoders = [
        w
        for w in live
        if w.decodes
        and w.worker_id != prefill.worker_id
        and facilities.get(w.worker_id, NORMAL).state != "drain"
    ]
    if not decoders:
        return aggregated("no live decode worker")
    # Decode does not read the prompt's cache, so overlap does not matter here: only load.
    decode = _best(
        decoders,
        RouteInput(request.request_id, request.model, 0, lora=request.lora),
        facilities,
        config,
    )
    if decode is None:
        return aggregated("every decode worker is full")
    reason = "disaggregation is forced"
    if config.disaggregation == "auto":
        choice = cost.compare(
            prefill, decode, request.num_prompt_tokens, request.max_tokens, config.costs
        )
        if not choice.disaggregate:
            return aggregated(choice.reason)
        reason = choice.reason
    return pb.Placement(
        prefill_worker_id=prefill.worker_id,
        decode_worker_id=decode.worker_id,
        disaggregated=True,
        reason=reason,
        expected_cached_tokens=cached,
    )


def fits(w: WorkerView, request: RouteInput) -> bool:
    """The worker's context holds the prompt and the tokens asked for (0: it did not say)."""
    limit = w.heartbeat.max_model_len
    needed = request.num_prompt_tokens + max(request.max_tokens, 1)
    return not limit or needed <= limit


def _cap(w: WorkerView, facility: WorkerThrottle) -> int:
    caps = [c for c in (w.max_num_seqs, w.seq_cap, facility.seq_cap) if c > 0]
    return min(caps) if caps else 1


def _best(
    candidates: list[WorkerView],
    request: RouteInput,
    facilities: Mapping[str, WorkerThrottle],
    config: PolicyConfig,
) -> WorkerView | None:
    """The candidate with the highest score among those with room, or None."""
    scored: list[tuple[float, str, WorkerView]] = []
    for w in candidates:
        base = free_score(w, facilities.get(w.worker_id, NORMAL), config, request.priority)
        if base is not None:
            scored.append((_overlap_score(w, request, config) + base, w.worker_id, w))
    if not scored:
        return None
    # Highest score wins; equal scores go to the smallest worker id, so ties are stable.
    return min(scored, key=lambda s: (-s[0], s[1]))[2]


def _next_in_turn(
    candidates: list[WorkerView],
    turn: int,
    facilities: Mapping[str, WorkerThrottle],
    config: PolicyConfig,
    priority: int = 0,
) -> WorkerView | None:
    """Round-robin: the `turn`-th of the candidates with room, by worker id, or None."""
    room = sorted(
        (
            w
            for w in candidates
            if free_score(w, facilities.get(w.worker_id, NORMAL), config, priority) is not None
        ),
        key=lambda w: w.worker_id,
    )
    return room[turn % len(room)] if room else None


def free_score(
    w: WorkerView, facility: WorkerThrottle, config: PolicyConfig, priority: int = 0
) -> float | None:
    """The part of a worker's score that does not depend on the request's prompt (its whole
    score for a prompt it holds nothing of): minus its busy share, KV use and facilities
    penalty. None when it has no room for a request of this priority. Higher is better."""
    if w.load >= _cap(w, facility) + queue_room(config, priority):
        return None
    return -busy_share(w, facility) - config.kv_weight * w.kv_used - facility.cost_penalty


def busy_share(w: WorkerView, facility: WorkerThrottle) -> float:
    """Its sequences (running, waiting, placed since its beat) over its cap, weighted by its
    rack's power state: 1.0 = every slot taken, above = a queue."""
    return w.load / _cap(w, facility) * facility.load_weight


def queue_room(config: PolicyConfig, priority: int) -> int:
    """How many requests of this priority may wait per worker beyond its cap."""
    if priority > 0:
        return int(config.queue_per_worker * config.low_priority_queue_share)
    return config.queue_per_worker


def _overlap_score(w: WorkerView, request: RouteInput, config: PolicyConfig) -> float:
    """The value of the prompt's cached share on this worker (0.0 when it holds none and
    the shared tier holds none either)."""
    if not request.num_prompt_tokens:
        return 0.0
    worth = _hit_tokens(w, request, config)[0]
    return config.overlap_weight * worth / request.num_prompt_tokens


def _hit_tokens(w: WorkerView, request: RouteInput, config: PolicyConfig) -> tuple[float, int]:
    """(worth in local tokens, tokens it will not compute) of the prompt's cached prefix
    there: its own blocks, then what the shared tier holds past them, priced as a pull."""
    bs = w.block_size
    local = min(request.cached_blocks.get(w.worker_id, 0) * bs, request.num_prompt_tokens)
    if not w.heartbeat.HasField("kv_layout"):  # no pool: it cannot fetch
        return float(local), local
    shared = min(request.shared_blocks * bs, request.num_prompt_tokens)
    value = pull_value(w, config)
    if shared <= local or value <= 0:
        return float(local), local
    return local + (shared - local) * value, shared


def pull_value(w: WorkerView, config: PolicyConfig) -> float:
    """A block fetched from the shared tier, as a share of the same block held locally:
    1 - fetch time / compute time of its tokens, both as the worker measured them."""
    hb = w.heartbeat
    fetch_ms, compute_ms = hb.kvcache_fetch_ms_per_block, hb.step_ms_per_token * w.block_size
    if fetch_ms <= 0 or compute_ms <= 0:
        return config.shared_hit_value
    return max(0.0, 1.0 - fetch_ms / compute_ms)


def _error(code: pb.RouteError.Code, message: str, retry_after_s: int = 0) -> pb.RouteError:
    return pb.RouteError(code=code, message=message, retry_after_s=retry_after_s)
