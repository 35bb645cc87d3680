"""The fleet as racks -> nodes -> workers, from heartbeats (tokenyard.fleet), the facilities
inventory and the latest rack states and readings; pure."""

from __future__ import annotations

from dataclasses import dataclass

from tokenyard.facilities.inventory import Inventory
from tokenyard.fleet import FleetView, WorkerView
from tokenyard.v1.facilities_pb2 import FacilityReading, RackState, RackStateKind

UNPLACED = "unplaced"  # the rack of workers the inventory does not name
RACK_STATES = {
    RackStateKind.RACK_STATE_NORMAL: "normal",
    RackStateKind.RACK_STATE_DERATE: "derate",
    RackStateKind.RACK_STATE_DRAIN: "drain",
}


@dataclass
class PrefixCounts:
    """Prompt tokens a worker prefilled and how many of them came from a cache: its own
    prefix cache, or the shared KV-cache service (``fetched_tokens``, a part of
    ``cached_tokens``)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    fetched_tokens: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def worker_json(
    w: WorkerView, now: float, missed: int, rack_state: str, prefix: PrefixCounts | None
) -> dict:
    hb = w.heartbeat
    alive = w.alive(now, missed)
    return {
        "worker_id": w.worker_id,
        "role": w.role,
        "model": w.model,
        # dead by the one liveness rule; otherwise its rack's facilities state
        "state": rack_state if alive else "dead",
        "alive": alive,
        "age_s": round(w.age(now), 2),
        "load": w.load,
        "num_running": hb.num_running,
        "num_waiting": hb.num_waiting,
        "max_num_seqs": hb.max_num_seqs,
        "seq_cap": hb.seq_cap,
        "kv_usage": round(w.kv_used, 4),
        "tokens_per_s": round(hb.tokens_per_s, 2),
        "prefix_hit_rate": prefix.hit_rate if prefix else None,
        "lora_adapters": list(hb.lora_adapters),  # the LoRA adapters it serves
    }


def rack_json(name: str, state: RackState | None, reading: FacilityReading | None) -> dict:
    def opt(field: str) -> float | None:
        return getattr(reading, field) if reading is not None and reading.HasField(field) else None

    return {
        "name": name,
        "state": RACK_STATES.get(state.state, "unknown") if state else "unknown",
        "reason": state.reason if state else "",
        "power_kw": reading.power_kw if reading is not None else None,
        "supply_c": opt("supply_c"),
        "return_c": opt("return_c"),
        "flow_lpm": opt("flow_lpm"),
        # Where the readings come from: "simulator" (modelled from the heartbeats, not
        # measured), or an exporter's name ("dcgm", "redfish", ...).
        "source": reading.source or None if reading is not None else None,
        "nodes": [],
    }


def fleet_tree(
    fleet: FleetView,
    now: float,
    inventory: Inventory | None,
    states: dict[str, RackState],
    readings: dict[str, FacilityReading],
    prefix: dict[str, PrefixCounts],
) -> list[dict]:
    """Racks (inventory order), each with its nodes and their workers; workers the inventory
    does not place go under an "unplaced" rack, one node per host."""
    racks: dict[str, dict] = {}
    placed: dict[str, tuple[str, str]] = {}  # worker -> (rack, node)
    for spec in inventory.racks if inventory else []:
        racks[spec.name] = rack_json(spec.name, states.get(spec.name), readings.get(spec.name))
        racks[spec.name]["power_cap_kw"] = spec.power_cap_kw
        for node in spec.nodes:
            racks[spec.name]["nodes"].append({"name": node.name, "workers": []})
            for worker_id in node.workers:
                placed[worker_id] = (spec.name, node.name)
    for w in sorted(fleet.workers.values(), key=lambda w: w.worker_id):
        rack_name, node_name = placed.get(w.worker_id, (UNPLACED, w.heartbeat.host or "?"))
        if rack_name not in racks:
            racks[rack_name] = rack_json(rack_name, None, None)
        rack = racks[rack_name]
        entry = next((n for n in rack["nodes"] if n["name"] == node_name), None)
        if entry is None:
            entry = {"name": node_name, "workers": []}
            rack["nodes"].append(entry)
        rack_state = rack["state"] if rack["state"] != "unknown" else "normal"
        entry["workers"].append(
            worker_json(w, now, fleet.missed, rack_state, prefix.get(w.worker_id))
        )
    return list(racks.values())
