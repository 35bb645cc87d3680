"""The physical inventory, loaded from YAML: site, coolant loops, racks, nodes, worker ids.

site: local
coolant_loops:
  - {name: loop-1, supply_limit_c: 32, return_limit_c: 45, min_flow_lpm: 20,
     nominal_supply_c: 25, nominal_flow_lpm: 30}
racks:
  - name: rack-a
    loop: loop-1
    power_cap_kw: 8
    nodes:
      - {name: node-a1, gpus: 8, gpu_tdp_w: 700, workers: [decode-0]}
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CoolantLoopSpec(_Strict):
    name: str
    supply_limit_c: float = 32.0
    return_limit_c: float = 45.0
    min_flow_lpm: float = Field(gt=0)
    # What the simulator models when nothing is wrong.
    nominal_supply_c: float = 25.0
    nominal_flow_lpm: float = Field(gt=0)


class NodeSpec(_Strict):
    name: str
    gpus: int = Field(ge=0)
    gpu_tdp_w: float = Field(ge=0)
    workers: list[str] = []


class RackSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")  # becomes a NATS subject token
    loop: str | None = None
    cooling: Literal["liquid", "air", "hybrid"] = "liquid"
    power_cap_kw: float = Field(gt=0)
    idle_power_kw: float = Field(default=1.0, ge=0)
    # simulator: modelled here from worker heartbeats; external: an exporter publishes readings.
    source: Literal["simulator", "external"] = "simulator"
    nodes: list[NodeSpec] = []

    @property
    def worker_ids(self) -> list[str]:
        return [w for node in self.nodes for w in node.workers]


class Inventory(_Strict):
    site: str = "local"
    coolant_loops: list[CoolantLoopSpec] = []
    racks: list[RackSpec]

    @model_validator(mode="after")
    def _consistent(self) -> Inventory:
        loops = {loop.name for loop in self.coolant_loops}
        for rack in self.racks:
            if rack.loop is not None and rack.loop not in loops:
                raise ValueError(f"rack {rack.name}: unknown coolant loop {rack.loop!r}")
            if rack.cooling != "air" and rack.loop is None:
                raise ValueError(f"rack {rack.name}: {rack.cooling} cooling needs a coolant loop")
        _unique("rack", [r.name for r in self.racks])
        _unique("node", [n.name for r in self.racks for n in r.nodes])
        _unique("worker", [w for r in self.racks for w in r.worker_ids])
        return self

    def rack(self, name: str) -> RackSpec:
        for rack in self.racks:
            if rack.name == name:
                return rack
        raise KeyError(name)

    def loop_of(self, rack: RackSpec) -> CoolantLoopSpec | None:
        return next((loop for loop in self.coolant_loops if loop.name == rack.loop), None)

    def worker_racks(self) -> dict[str, str]:
        return {w: rack.name for rack in self.racks for w in rack.worker_ids}


def _unique(kind: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{kind} {name!r} appears twice in the inventory")
        seen.add(name)


def load_inventory(path: str | Path) -> Inventory:
    with open(path, encoding="utf-8") as f:
        return Inventory.model_validate(yaml.safe_load(f))
