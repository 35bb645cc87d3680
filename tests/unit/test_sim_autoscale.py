"""The autoscaler in the fleet simulator: a small fleet over a short day with a burst."""

from __future__ import annotations

import json

import pytest

from tokenyard.autoscale.policy import AutoscaleSettings
from tokenyard.cli import main
from tokenyard.planner import catalog
from tokenyard.planner.roofline import Deployment
from tokenyard.sim.autoscale import SimAutoscaler, SimScaling, full_load_kw
from tokenyard.sim.fleet import FleetSpec, build_fleet
from tokenyard.sim.simulator import SimConfig, Simulation
from tokenyard.sim.workload import DAY_CURVE, WorkloadSpec, day_rate, generate

H100 = catalog.HARDWARE["h100"]
M8B = catalog.model("llama-3.1-8b")


def test_the_day_follows_its_curve_and_its_burst():
    spec = WorkloadSpec(kind="day", rate=100.0, day_s=24.0, day_burst_at=0.5, day_burst_s=1.0,
                        day_burst_factor=2.0)  # fmt: skip
    assert day_rate(4.0, spec) == pytest.approx(100 * DAY_CURVE[4])
    assert day_rate(12.5, spec) == pytest.approx(2 * 100 * (DAY_CURVE[12] + DAY_CURVE[13]) / 2)
    reqs = generate(spec)
    burst = sum(1 for r in reqs if 12.0 <= r.arrival_s < 13.0)
    before = sum(1 for r in reqs if 11.0 <= r.arrival_s < 12.0)
    assert burst > 1.5 * before
    assert all(0 <= r.arrival_s < 24.0 for r in reqs)


def _run(mode: str, reqs, scaler_class=SimAutoscaler, **settings):
    dep = Deployment(M8B, H100, tp=8)
    spec = FleetSpec(0, 0, slots=16, max_num_seqs=8, rack_cap_spread=0.6)
    workers, inventory = build_fleet(dep, spec, M8B.name)
    node = inventory.racks[0].nodes[0]
    s = AutoscaleSettings(mode=mode, worker_full_kw=full_load_kw(node, SimConfig()),
                          node_fixed_kw=node.gpus * node.gpu_tdp_w * workers[0].fixed_share / 1000,
                          down_after_s=4, down_cooldown_s=6, **settings)  # fmt: skip
    scaler = scaler_class(s, SimScaling(interval_s=1.0, start_s=2.0, initial=(1, 1)))
    sim = Simulation(workers, inventory, reqs, SimConfig(policy="kv-aware+facilities"), scaler)
    return sim.run(), scaler, workers, inventory


REQS = generate(WorkloadSpec(kind="day", rate=60.0, prompt_len=1024, output_len=64, day_s=60.0,
                             day_burst_s=5.0, day_burst_factor=2.0))  # fmt: skip


def test_the_fleet_grows_with_the_load_and_drains_back_losing_nothing():
    result, scaler, workers, _ = _run("sla", REQS)
    assert result.completed == len(REQS) and result.rejected == 0
    counts = [p + d for _, p, d in scaler.timeline]
    assert max(counts) > counts[0] and scaler.drained > 0
    assert 0 < result.slo_attainment <= 1 and result.gpu_hours > 0 and result.energy_kwh > 0


def test_power_mode_keeps_every_rack_inside_its_budget():
    seen = []

    class Checked(SimAutoscaler):
        def apply(self, sim, decision):  # after every decision, the committed power
            super().apply(sim, decision)
            for rack in sim.inventory.racks:
                on = [sim.workers[w] for w in rack.worker_ids if sim.workers[w].power != "off"]
                committed = sum(self.settings.draw_kw(w.role) for w in on)
                seen.append(committed / (self.settings.rack_budget * rack.power_cap_kw))

    result, scaler, _, _ = _run("power", REQS, scaler_class=Checked)
    assert result.completed == len(REQS)
    assert result.throttle_events == 0
    assert seen and max(seen) <= 1.0 + 1e-9
    assert scaler.started > 2  # it did scale


def test_energy_counts_only_switched_on_nodes():
    # the same requests on a fleet scaled down to its minimum use less energy than on one
    # held at sixteen workers (by a minimum no load reaches)
    few, *_ = _run("sla", REQS[:50])
    many, *_ = _run("sla", REQS[:50], min_workers={"prefill": 8, "decode": 8})
    assert few.gpu_hours < many.gpu_hours and few.energy_kwh < many.energy_kwh


def test_cli_autoscale_json_reports_both_modes(capsys):
    argv = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--gpus", "16",
            "--autoscale", "both", "--day-s", "6", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["autoscale"] for r in out["runs"]] == ["sla", "power"]
    for key in ("slo_attainment", "gpu_hours", "energy_kwh", "capping_events"):
        assert key in out and all(key in r for r in out["runs"])
    assert out["autoscale"] == "power"


def test_cli_autoscale_refuses_round_robin(capsys):
    argv = ["simulate", "--gpus", "16", "--autoscale", "sla", "--policy", "round-robin"]
    assert main(argv) == 2
    assert "--autoscale" in capsys.readouterr().err
