"""When a LoRA adapter's holders are all busy, which other worker should load it.

``choose`` (routing.policy) places a request on an adapter only among the workers that hold
it: a holder never pays a load. When every holder is busy beyond
``PolicyConfig.lora_load_busy`` (its running and waiting sequences over its cap, as
``free_score`` counts them) and another worker of the model has room for one more adapter
and is less busy than that, the router asks it to load the adapter from the folder a
holder names (services/router/lora_loads.py). The request in hand still goes to a holder
(a load takes longer than a route may wait); once the worker confirms, it holds the
adapter and, being the least busy, takes the next requests.

    target = load_target(workers, request, now, facilities=..., config=...)
    # -> LoadPlan(worker_id, lora, path) or None
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenyard.facilities.tracker import WorkerThrottle
from tokenyard.fleet import WorkerView
from tokenyard.routing.policy import NORMAL, PolicyConfig, RouteInput, busy_share, fits


@dataclass(frozen=True)
class LoadPlan:
    worker_id: str  # the worker to load the adapter on
    lora: str
    path: str  # the adapter's folder, as a holder's heartbeat names it


def load_target(
    workers: Mapping[str, WorkerView],
    request: RouteInput,
    now: float,
    *,
    facilities: Mapping[str, WorkerThrottle] | None = None,
    config: PolicyConfig | None = None,
) -> LoadPlan | None:
    """The worker that should load ``request.lora`` now, or None (its holders do)."""
    config = config or PolicyConfig()
    facilities = facilities or {}
    if not request.lora:
        return None
    candidates = [
        w
        for w in workers.values()
        if w.alive(now, config.missed_heartbeats)
        and w.ready
        and not w.draining
        and (w.prefills or w.local_prefill)
        and (not request.model or w.model == request.model)
        and fits(w, request)
        and facilities.get(w.worker_id, NORMAL).state != "drain"
    ]

    def busy(w: WorkerView) -> float:
        return busy_share(w, facilities.get(w.worker_id, NORMAL))

    holders = [w for w in candidates if request.lora in w.heartbeat.lora_adapters]
    if not holders or any(busy(w) < config.lora_load_busy for w in holders):
        return None  # loaded nowhere (nothing to copy from), or a holder has room
    paths = [w.heartbeat.lora_paths.get(request.lora, "") for w in holders]
    path = next((p for p in paths if p), "")
    spare = [
        w
        for w in candidates
        if request.lora not in w.heartbeat.lora_adapters
        and w.heartbeat.lora_room > 0
        and busy(w) < config.lora_load_busy
    ]
    if not path or not spare:
        return None
    target = min(spare, key=lambda w: (busy(w), w.worker_id))
    return LoadPlan(target.worker_id, request.lora, path)
