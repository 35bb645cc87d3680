"""The simulator's physics, heartbeat utilization and the inventory loader."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tokenyard.facilities.inventory import Inventory, load_inventory
from tokenyard.facilities.simulator import (
    Faults,
    RackSimulator,
    SimSettings,
    coolant_rise_c,
    rack_power_kw,
    utilization,
)
from tokenyard.v1.serving_pb2 import WorkerHeartbeat


@pytest.fixture
def inventory(example_inventory: Path) -> Inventory:
    return load_inventory(example_inventory)


def test_example_inventory_maps_workers_to_two_racks(inventory: Inventory) -> None:
    racks = inventory.worker_racks()
    assert racks["prefill-1"] == "rack-a" and racks["decode-2"] == "rack-b"
    assert racks["both-1"] == "rack-a" and racks["both-2"] == "rack-b"
    assert {r.name for r in inventory.racks} == {"rack-a", "rack-b"}


def test_inventory_rejects_duplicates_and_unknown_loops() -> None:
    rack = {
        "name": "r1",
        "power_cap_kw": 5,
        "cooling": "air",
        "nodes": [{"name": "n", "gpus": 1, "gpu_tdp_w": 1, "workers": ["w"]}],
    }
    with pytest.raises(ValidationError, match="worker 'w' appears twice"):
        Inventory.model_validate(
            {
                "racks": [
                    rack,
                    {
                        **rack,
                        "name": "r2",
                        "nodes": [{"name": "n2", "gpus": 1, "gpu_tdp_w": 1, "workers": ["w"]}],
                    },
                ]
            }
        )
    with pytest.raises(ValidationError, match="unknown coolant loop"):
        Inventory.model_validate({"racks": [{**rack, "loop": "nope"}]})


def test_utilization_from_occupancy_or_token_rate() -> None:
    hb = WorkerHeartbeat(worker_id="w", num_running=2, max_num_seqs=8, tokens_per_s=50)
    assert utilization(hb, 0.0) == 0.25
    assert utilization(hb, 100.0) == 0.5
    assert utilization(WorkerHeartbeat(num_running=20, max_num_seqs=8), 0.0) == 1.0
    assert utilization(WorkerHeartbeat(), 0.0) == 0.0


def test_rack_power_is_idle_plus_utilization_times_tdp(inventory: Inventory) -> None:
    rack = inventory.rack("rack-a")
    assert rack_power_kw(rack, {}) == pytest.approx(1.5)
    # The running workers share node-a1's 8 GPUs: the node runs at their mean utilization.
    assert rack_power_kw(rack, {"prefill-1": 1.0, "decode-3": 1.0, "both-1": 1.0}) == pytest.approx(
        1.5 + 5.6
    )
    assert rack_power_kw(rack, {"decode-3": 0.75}) == pytest.approx(1.5 + 5.6 * 0.75)
    assert rack_power_kw(rack, {"decode-3": 0.5, "prefill-1": 0.0}) == pytest.approx(
        1.5 + 5.6 * 0.25
    )


def test_coolant_rise() -> None:
    # 60 L/min of water is 1 kg/s: 41.86 kW heat it by 10 K.
    assert coolant_rise_c(41.86, 60.0, SimSettings()) == pytest.approx(10.0)


def test_return_temperature_lags_toward_its_target(inventory: Inventory) -> None:
    rack = inventory.rack("rack-a")
    settings = SimSettings(time_constant_s=10.0)
    sim = RackSimulator(rack, inventory.loop_of(rack), settings, now=0.0)
    full = {"prefill-1": 1.0, "decode-3": 1.0, "both-1": 1.0}
    target = 25.0 + coolant_rise_c(7.1, 30.0, settings)
    first = sim.step(10.0, full, Faults())  # one time constant: 63% of the way
    assert first.return_c == pytest.approx(25.0 + 0.632 * (target - 25.0), rel=1e-3)
    for t in range(20, 200, 10):
        last = sim.step(float(t), full, Faults())
    assert last.return_c == pytest.approx(target, rel=1e-3)


def test_pump_and_chiller_failures(inventory: Inventory) -> None:
    rack = inventory.rack("rack-a")
    sim = RackSimulator(rack, inventory.loop_of(rack), SimSettings(time_constant_s=0.0), now=0.0)
    pump = sim.step(1.0, {}, Faults(pump_failure=True))
    assert pump.flow_lpm == pytest.approx(3.0)
    assert pump.return_c == pytest.approx(25.0 + coolant_rise_c(1.5, 3.0, SimSettings()))
    chiller = sim.step(2.0, {}, Faults(chiller_failure=True))
    assert chiller.supply_c == pytest.approx(37.0)
    assert chiller.flow_lpm == pytest.approx(30.0)
