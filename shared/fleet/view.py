"""What a service knows about the fleet: the latest heartbeat of every worker.

Pure state with an explicit clock: a service's bus handler feeds every pb.WorkerHeartbeat
in with its own clock's ``now`` (monotonic in the router, gateway and workers; wall time in
the facilities service) and asks with the same clock; tests script both.

    fleet = FleetView(missed_heartbeats=3)
    fleet.on_heartbeat(hb, now)
    fleet.live(now)               # -> [WorkerView, ...]
    fleet.is_dead("decode-0", now)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from tokenyard.facilities.tracker import RackStateTracker
from tokenyard.fleet import liveness
from tokenyard.fleet.roles import can_decode, can_prefill
from tokenyard.v1 import kv_pb2
from tokenyard.v1 import serving_pb2 as pb

# A dead worker is forgotten this long after it died (its KV events may still be arriving).
FORGET_GRACE_S = 10.0


@dataclass(frozen=True)
class WorkerView:
    """One worker as its last heartbeat described it, with the defaults of a zero field.

    Immutable (a new beat or placement makes a new view), so each derived value is computed
    once: the router reads them for every worker on every request.
    """

    heartbeat: pb.WorkerHeartbeat
    last_seen: float  # the receiver's clock when that heartbeat arrived
    pending: int = 0  # placed here by this router since that heartbeat
    pending_decodes: int = 0  # of those, the ones that also decode here
    pending_prompt_tokens: int = 0  # their prompt tokens

    @cached_property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id

    @cached_property
    def role(self) -> str:
        return self.heartbeat.role

    @cached_property
    def model(self) -> str:
        return self.heartbeat.model

    @cached_property
    def prefills(self) -> bool:
        return can_prefill(self.role)

    @cached_property
    def local_prefill(self) -> bool:
        """A decode worker that also runs whole requests (prefills its own)."""
        return self.heartbeat.local_prefill

    @cached_property
    def decodes(self) -> bool:
        return can_decode(self.role)

    @cached_property
    def ready(self) -> bool:
        """It says it can take work (alive is another matter: a worker whose engine is stuck
        still beats, and one whose work-queue consumer is gone still runs its requests)."""
        return not self.heartbeat.not_ready

    @cached_property
    def draining(self) -> bool:
        """Drained by an operator: alive, finishing its requests, taking no new ones."""
        return self.heartbeat.draining

    @cached_property
    def interval_s(self) -> float:
        return liveness.announced_interval_s(self.heartbeat)

    @cached_property
    def max_num_seqs(self) -> int:
        return self.heartbeat.max_num_seqs or 1

    @cached_property
    def seq_cap(self) -> int:
        return self.heartbeat.seq_cap  # 0 = no cap beyond max_num_seqs

    @cached_property
    def block_size(self) -> int:
        return self.heartbeat.block_size or 16

    @cached_property
    def num_free_blocks(self) -> int:
        return self.heartbeat.num_free_blocks

    @cached_property
    def load(self) -> int:
        return self.heartbeat.num_running + self.heartbeat.num_waiting + self.pending

    @cached_property
    def kv_used(self) -> float:
        total = self.heartbeat.num_blocks
        return 1.0 - self.heartbeat.num_free_blocks / total if total else 0.0

    def age(self, now: float) -> float:
        return now - self.last_seen

    def alive(self, now: float, missed: int = liveness.DEFAULT_MISSED_HEARTBEATS) -> bool:
        return liveness.is_alive(self.age(now), self.interval_s, missed)


class FleetView:
    """Every worker heard from, by id; liveness by the one rule, ``missed_heartbeats`` deep.

    ``racks`` holds the facilities service's latest word on each rack, for the services
    that place work (the router); the others leave it empty.
    """

    def __init__(
        self,
        missed_heartbeats: int = liveness.DEFAULT_MISSED_HEARTBEATS,
        racks: RackStateTracker | None = None,
    ) -> None:
        self.missed = missed_heartbeats
        self.workers: dict[str, WorkerView] = {}
        self.racks = racks if racks is not None else RackStateTracker()

    def on_heartbeat(self, hb: pb.WorkerHeartbeat, now: float) -> None:
        # A new beat already counts what was placed before it: pending starts over.
        self.workers[hb.worker_id] = WorkerView(hb, now)

    def placed(self, worker_id: str, *, decodes: bool = True, prompt_tokens: int = 0) -> None:
        """Count a placement on ``worker_id`` until its next heartbeat counts it itself."""
        w = self.workers.get(worker_id)
        if w is not None:
            self.workers[worker_id] = dataclasses.replace(
                w,
                pending=w.pending + 1,
                pending_decodes=w.pending_decodes + decodes,
                pending_prompt_tokens=w.pending_prompt_tokens + prompt_tokens,
            )

    def note_adapter(self, worker_id: str, name: str, *, held: bool) -> None:
        """A LoRA load or unload the worker confirmed, seen before its next heartbeat says so."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        hb = pb.WorkerHeartbeat()
        hb.CopyFrom(w.heartbeat)
        adapters = set(hb.lora_adapters) | {name} if held else set(hb.lora_adapters) - {name}
        hb.ClearField("lora_adapters")
        hb.lora_adapters.extend(sorted(adapters))
        self.workers[worker_id] = dataclasses.replace(w, heartbeat=hb)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.workers

    def get(self, worker_id: str) -> WorkerView | None:
        return self.workers.get(worker_id)

    def alive(self, worker_id: str, now: float) -> bool:
        """True for a worker heard from recently enough; an unknown worker is not alive."""
        w = self.workers.get(worker_id)
        return w is not None and w.alive(now, self.missed)

    def is_dead(self, worker_id: str, now: float) -> bool:
        """True only for a worker seen once and silent since; an unknown worker is not dead."""
        w = self.workers.get(worker_id)
        return w is not None and not w.alive(now, self.missed)

    def live(self, now: float) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.alive(now, self.missed)]

    def ready(self, now: float) -> list[WorkerView]:
        """Live workers that say they can take work."""
        return [w for w in self.live(now) if w.ready]

    def forget_dead(self, now: float, grace_s: float = FORGET_GRACE_S) -> list[str]:
        """Drop workers dead for longer than ``grace_s``; returns their ids."""
        dead = [
            w.worker_id
            for w in self.workers.values()
            if w.age(now) > liveness.silence_limit_s(w.interval_s, self.missed) + grace_s
        ]
        for worker_id in dead:
            del self.workers[worker_id]
        return dead

    def roles(self, now: float) -> dict[str, int]:
        counts: dict[str, int] = {}
        for w in self.live(now):
            counts[w.role] = counts.get(w.role, 0) + 1
        return counts

    def max_model_len(self, now: float) -> int:
        """The longest context a live worker serves (0 = unknown).

        NOTE: the longest, not the smallest: a worker says what it likes about itself, and
        one claiming a context of 1 token must not shorten everyone's. The router places a
        request only on workers whose own context holds it (routing.policy.fits)."""
        lens = [w.heartbeat.max_model_len for w in self.live(now) if w.heartbeat.max_model_len]
        return max(lens) if lens else 0

    def kv_layout(self, model: str, now: float) -> kv_pb2.KVLayoutDesc | None:
        """The KV layout a live worker of ``model`` (any, when "") announces; None if none
        has a pool. Workers of one model share a layout, or the KV-cache service keeps
        their blocks apart anyway (it namespaces them by layout)."""
        for w in self.ready(now):
            if (not model or w.model == model) and w.heartbeat.HasField("kv_layout"):
                return w.heartbeat.kv_layout
        return None

    def models(self, now: float) -> set[str]:
        return {w.model for w in self.live(now) if w.model}

    def adapters(self, now: float) -> dict[str, str]:
        """LoRA adapter -> the base model of the live workers that serve it."""
        return {a: w.model for w in self.live(now) for a in w.heartbeat.lora_adapters}
