"""`tokenyard simulate`: a fleet of hundreds to thousands of accelerators, placed by our router.

    tokenyard simulate --model llama-3.1-70b --gpu h100 --gpus 1000 --requests 100000 \\
        --workload shared-prefix --policy all --png fleet.png

The fleet is sized from the planner: replicas of the planned parallelism, split between
prefill and decode at the planned ratio (or each of `--pd-ratios`), fed at `--load` times
what its decode replicas can carry. Every policy (and ratio) sees the same requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenyard.cli.plan import add_workload_arguments, model_from, workload_from
from tokenyard.planner import catalog
from tokenyard.planner.plan import PlanError, make_plan
from tokenyard.planner.roofline import Deployment
from tokenyard.sim.fleet import FleetSpec, build_fleet
from tokenyard.sim.simulator import POLICIES, SimConfig, Simulation
from tokenyard.sim.workload import WorkloadSpec, from_bench, generate

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--gpus", type=int, default=1000, help="accelerators in the fleet")
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument(
        "--workload",
        default="shared-prefix",
        choices=["poisson", "bursts", "shared-prefix", "multi-turn", "day"],
    )
    parser.add_argument(
        "--bench",
        default=None,
        help="replay the requests of `tokenyard bench serve --out` results "
        "(or a JSONL of its records) instead",
    )
    parser.add_argument(
        "--load",
        type=float,
        default=None,
        help="arrival rate as a share of the decode replicas' capacity "
        "(default 0.9; with --autoscale the day's peak, default 0.4)",
    )
    parser.add_argument("--policy", default="all", choices=["all", *POLICIES])
    parser.add_argument(
        "--pd-ratios",
        default="",
        help="prefill:decode splits to compare, e.g. 1:2,1:3 (default: planned)",
    )
    parser.add_argument(
        "--oversubscription",
        type=float,
        default=0.85,
        help="rack power cap over its servers' nameplate",
    )
    parser.add_argument(
        "--rack-cap-spread",
        type=float,
        default=0.15,
        help="racks' caps spread down to this share below the oversubscribed cap",
    )
    parser.add_argument(
        "--autoscale",
        default=None,
        choices=["sla", "power", "both"],
        help="scale the fleet over a day's load curve with a burst (--workload day): "
        "to the SLOs alone, or inside each rack's power budget",
    )
    parser.add_argument(
        "--day-s",
        type=float,
        default=240.0,
        help="with --autoscale: simulated seconds the day is compressed into",
    )
    parser.add_argument(
        "--burst-factor",
        type=float,
        default=1.5,
        help="with --autoscale: the burst's rate over the curve's",
    )
    parser.add_argument(
        "--burst-s",
        type=float,
        default=10.0,
        help="with --autoscale: how long the burst lasts (at mid-day)",
    )
    parser.add_argument(
        "--start-s",
        type=float,
        default=5.0,
        help="with --autoscale: from starting a worker to its serving",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--png", default=None, help="write a comparison chart here")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    try:
        report = simulate(args)
    except (PlanError, ValueError, FileNotFoundError) as exc:
        print(f"tokenyard simulate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(public(report), indent=2))
    else:
        show(report)
    if args.png:
        path = Path(args.png)
        plot(report, path)
        # stderr: stdout may be the JSON report.
        print(f"chart written to {path.resolve()}", file=sys.stderr)
    return 0


def _ratios(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        p, _, d = part.partition(":")
        if not p.isdigit() or not d.isdigit() or int(p) + int(d) == 0:
            raise ValueError(f"--pd-ratios: {part!r} is not PREFILL:DECODE")
        out.append((int(p), int(d)))
    return out


def simulate(args: argparse.Namespace) -> dict:
    model, hw = model_from(args), catalog.hardware(args.gpu)
    wl = workload_from(args)
    plan = make_plan(model, hw, wl, weights_dtype=args.weights_dtype, kv_dtype=args.kv_dtype)
    dep = Deployment(model, hw, plan.tp, plan.pp, args.weights_dtype, args.kv_dtype)
    replicas = args.gpus // dep.gpus
    if replicas < 2:
        raise ValueError(f"--gpus {args.gpus}: fewer than two replicas of {dep.gpus} GPUs")
    if args.autoscale:
        from tokenyard.cli.simulate_day import simulate_day

        return simulate_day(args, model, hw, wl, plan, dep, replicas)
    if args.load is None:
        args.load = 0.9
    ratios = _ratios(args.pd_ratios) or [(plan.prefill_replicas, plan.decode_replicas)]
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    runs = []
    started = time.perf_counter()
    for p, d in ratios:
        prefill = max(1, min(replicas - 1, round(replicas * p / (p + d)))) if p else 0
        spec = FleetSpec(prefill, replicas - prefill, max_num_seqs=plan.decode_batch,
                         racks_power_oversubscription=args.oversubscription,
                         rack_cap_spread=args.rack_cap_spread)  # fmt: skip
        if prefill == 0:
            spec = replace(spec, decode_replicas=0, both_replicas=replicas)
        decoders = spec.decode_replicas or spec.both_replicas
        rate = args.load * decoders * plan.decode_batch / (wl.output_len / wl.tps_per_user)
        if args.bench:
            requests = from_bench(args.bench)
        else:
            requests = generate(
                WorkloadSpec(kind=args.workload, requests=args.requests, rate=rate,
                             prompt_len=wl.prompt_len, output_len=wl.output_len, seed=args.seed)
            )  # fmt: skip
        for policy in policies:
            workers, inventory = build_fleet(dep, spec, model.name)
            config = SimConfig(policy=policy, ttft_slo_s=wl.ttft_slo_ms / 1e3,
                               itl_slo_s=wl.itl_target_s, network_gbs=args.network_gbs)  # fmt: skip
            t = time.perf_counter()
            result = Simulation(workers, inventory, requests, config).run()
            runs.append(
                {"pd_ratio": f"{spec.prefill_replicas}:{decoders}", "racks": len(inventory.racks),
                 "rate_req_s": round(rate, 2), "wall_s": round(time.perf_counter() - t, 2),
                 **result.to_json(), "_timeline": result.power_timeline,
                 "_cap_kw": {r.name: r.power_cap_kw for r in inventory.racks}}
            )  # fmt: skip
    return {
        "model": model.name,
        "hardware": hw.name,
        "gpus": replicas * dep.gpus,
        "tp": dep.tp,
        "pp": dep.pp,
        "workload": args.workload if not args.bench else "bench",
        "requests": args.requests,
        "wall_s": round(time.perf_counter() - started, 2),
        "runs": runs,
        **_headline(runs),
    }


def _headline(runs: list[dict]) -> dict:
    """The top-level figures: the facilities-aware run's when there is one, else the first."""
    best = next((r for r in runs if r["policy"] == "kv-aware+facilities"), runs[0])
    keys = ("goodput_req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "throttle_events", "rack_peak_kw", "prefix_hit_rate")  # fmt: skip
    return {k: best[k] for k in keys}


def public(report: dict) -> dict:
    """The report without the per-rack timelines (for JSON output)."""
    return {**report, "runs": [{k: v for k, v in r.items() if not k.startswith("_")}
                               for r in report["runs"]]}  # fmt: skip


# The runs' figures in two tables, each under 80 columns: (heading, key of a run) per column.
LATENCY_COLUMNS = (
    ("P:D", "pd_ratio"),
    ("policy", "policy"),
    ("goodput\nreq/s", "goodput_req_s"),
    ("TTFT p50\nms", "ttft_p50_ms"),
    ("TTFT p99\nms", "ttft_p99_ms"),
    ("ITL p50\nms", "itl_p50_ms"),
    ("ITL p99\nms", "itl_p99_ms"),
)
DAY_COLUMNS = (
    ("P:D", "pd_ratio"),
    ("policy", "policy"),
    ("SLO\nattained", "slo_attainment"),
    ("GPU-h", "gpu_hours"),
    ("energy\nkWh", "energy_kwh"),
    ("capping\nevents", "capping_events"),
    ("peak\nworkers", "peak_workers"),
)
FLEET_COLUMNS = (
    ("P:D", "pd_ratio"),
    ("policy", "policy"),
    ("prefix\nhit rate", "prefix_hit_rate"),
    ("throttle\nevents", "throttle_events"),
    ("rack peak\nkW", "rack_peak_kw"),
    ("rejected", "rejected"),
)


def show(report: dict, console: Console | None = None) -> None:
    from rich.console import Console

    console = console or Console()
    console.print(
        f"{report['model']} on {report['gpus']} x {report['hardware']} (tp {report['tp']}), "
        f"{report['workload']}"
    )
    if report["workload"] == "day":
        console.print(_table("autoscaling over the day", DAY_COLUMNS, report["runs"]))
    console.print(_table("latency", LATENCY_COLUMNS, report["runs"]))
    console.print(_table("fleet and power", FLEET_COLUMNS, report["runs"]))


def _table(title: str, columns: tuple[tuple[str, str], ...], runs: list[dict]) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for i, (heading, _) in enumerate(columns):
        # NOTE: the ratio and the policy never shrink: a cut name says nothing.
        table.add_column(heading, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for r in runs:
        table.add_row(*(_figure(r[key]) for _, key in columns))
    return table


def _figure(value: object) -> str:
    """A float to the digits worth reading (the JSON keeps them all); others as they are."""
    if not isinstance(value, float):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = [f"{r['policy']}\n{r['pd_ratio']}" for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    for ax, key, title in (
        (axes[0], "goodput_req_s", "goodput (req/s within SLOs)"),
        (axes[1], "ttft_p99_ms", "TTFT p99 (ms)"),
        (axes[2], "throttle_events", "power-capping events (rack-intervals)"),
    ):
        ax.bar(range(len(runs)), [r[key] for r in runs], color="tab:blue")
        ax.set_xticks(range(len(runs)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    ax = axes[3]
    for r in runs:
        # The hottest rack of each run, as a share of its cap, over time.
        hottest = max(
            r["_timeline"], key=lambda k: max((p for _, p in r["_timeline"][k]), default=0)
        )
        cap = r["_cap_kw"][hottest]
        points = r["_timeline"][hottest]
        ax.plot([t for t, _ in points], [p / cap for _, p in points], lw=0.8,
                label=f"{r['policy']} {r['pd_ratio']}")  # fmt: skip
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_title("hottest rack: power / cap", fontsize=9)
    ax.set_xlabel("s")
    ax.legend(fontsize=6)
    fig.suptitle(f"{report['model']}, {report['gpus']} x {report['hardware']}, "
                 f"{report['requests']} requests ({report['workload']})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
