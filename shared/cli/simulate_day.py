"""`tokenyard simulate --autoscale sla|power|both`: a day's load curve with a burst, on a fleet
whose workers the autoscaler starts and drains (`tokenyard.sim.autoscale`).

Every node starts off; the day begins with the fleet the planner's figures give for its
first rate, and from then on `autoscale.policy.decide` sizes and places the pools. Both
modes see the same requests.
"""

from __future__ import annotations

import argparse
import math
import time

from tokenyard.autoscale.policy import AutoscaleSettings
from tokenyard.planner.catalog import Hardware, ModelSpec
from tokenyard.planner.plan import Plan, Workload
from tokenyard.planner.roofline import Deployment
from tokenyard.sim.autoscale import SimAutoscaler, SimScaling, full_load_kw
from tokenyard.sim.fleet import FleetSpec, build_fleet
from tokenyard.sim.simulator import SimConfig, Simulation
from tokenyard.sim.workload import WorkloadSpec, day_rate, generate

DEFAULT_PEAK_LOAD = 0.4


def simulate_day(
    args: argparse.Namespace,
    model: ModelSpec,
    hw: Hardware,
    wl: Workload,
    plan: Plan,
    dep: Deployment,
    replicas: int,
) -> dict:
    if args.policy == "round-robin":
        raise ValueError("--autoscale needs the router's policy (kv-aware or kv-aware+facilities)")
    policy = "kv-aware+facilities" if args.policy == "all" else args.policy
    load = DEFAULT_PEAK_LOAD if args.load is None else args.load
    # The peak rate: `load` x what the whole fleet carries at the planned prefill:decode split.
    decoders = replicas * plan.decode_replicas / (plan.prefill_replicas + plan.decode_replicas)
    answer_s = wl.output_len / wl.tps_per_user
    peak = load * decoders * plan.decode_batch / answer_s
    spec = WorkloadSpec(kind="day", rate=peak, prompt_len=wl.prompt_len,
                        output_len=wl.output_len, day_s=args.day_s,
                        day_burst_factor=args.burst_factor, day_burst_s=args.burst_s,
                        seed=args.seed)  # fmt: skip
    requests = generate(spec)
    modes = ["sla", "power"] if args.autoscale == "both" else [args.autoscale]
    runs = []
    started = time.perf_counter()
    for mode in modes:
        fleet = FleetSpec(0, 0, slots=replicas, max_num_seqs=plan.decode_batch,
                          racks_power_oversubscription=args.oversubscription,
                          rack_cap_spread=args.rack_cap_spread)  # fmt: skip
        workers, inventory = build_fleet(dep, fleet, model.name)
        node = inventory.racks[0].nodes[0]
        config = SimConfig(policy=policy, ttft_slo_s=wl.ttft_slo_ms / 1e3,
                           itl_slo_s=wl.itl_target_s, network_gbs=args.network_gbs)  # fmt: skip
        settings = AutoscaleSettings(
            mode=mode,  # type: ignore[arg-type]
            ttft_p99_s=wl.ttft_slo_ms / 1e3,
            itl_p99_s=wl.itl_target_s,
            worker_full_kw=full_load_kw(node, config),
            node_fixed_kw=node.gpus * node.gpu_tdp_w * workers[0].fixed_share / 1000,
        )
        first = day_rate(0.0, spec)
        initial = (
            math.ceil(first * dep.prefill_s(wl.prompt_len) / settings.target),
            math.ceil(first * answer_s / plan.decode_batch / settings.target),
        )
        scaler = SimAutoscaler(settings, SimScaling(start_s=args.start_s, initial=initial))
        t = time.perf_counter()
        result = Simulation(workers, inventory, requests, config, scaler).run()
        runs.append(
            {"pd_ratio": "auto", "autoscale": mode, "racks": len(inventory.racks),
             "peak_rate_req_s": round(peak, 2), "wall_s": round(time.perf_counter() - t, 2),
             **result.to_json(), "policy": f"{policy}, autoscale {mode}",
             "capping_events": result.throttle_events,
             "workers_started": scaler.started, "workers_drained": scaler.drained,
             "starts_over_budget": scaler.blocked,
             "peak_workers": max((p + d for _, p, d in scaler.timeline), default=0),
             "_timeline": result.power_timeline, "_workers": result.workers_timeline,
             "_cap_kw": {r.name: r.power_cap_kw for r in inventory.racks}}
        )  # fmt: skip
    headline = runs[-1]
    return {
        "model": model.name,
        "hardware": hw.name,
        "gpus": replicas * dep.gpus,
        "tp": dep.tp,
        "pp": dep.pp,
        "workload": "day",
        "day_s": args.day_s,
        "requests": len(requests),
        "wall_s": round(time.perf_counter() - started, 2),
        "runs": runs,
        **{k: headline[k] for k in HEADLINE},
    }


# The top-level figures (of the last mode run: power when both ran).
HEADLINE = ("autoscale", "slo_attainment", "gpu_hours", "energy_kwh", "capping_events",
            "goodput_req_s", "ttft_p99_ms", "itl_p99_ms")  # fmt: skip
