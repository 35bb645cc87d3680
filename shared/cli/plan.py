"""`tokenyard plan`: how many accelerators, racks and kW a model and a workload need."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from tokenyard.planner import catalog
from tokenyard.planner.plan import Plan, PlanError, PlanSettings, Workload, make_plan


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="llama-3.1-70b", help=f"a preset: {', '.join(sorted(catalog.MODELS))}"
    )
    parser.add_argument(
        "--gpu",
        default="h100",
        help=f"accelerator: {', '.join([*sorted(catalog.HARDWARE), 'cpu'])}",
    )
    parser.add_argument("--weights-dtype", default="bf16", choices=sorted(catalog.DTYPE_BYTES))
    parser.add_argument("--kv-dtype", default="bf16", choices=sorted(catalog.DTYPE_BYTES))
    parser.add_argument("--users", type=int, default=1000, help="concurrent conversations")
    parser.add_argument("--tps-per-user", type=float, default=20.0)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=0.0, help="0: 1000 / --tps-per-user")
    parser.add_argument("--prefix-hit-rate", type=float, default=0.0)
    # Explicit parameters override the preset's (or make a model of their own).
    for name in ("total-params", "active-params"):
        parser.add_argument(f"--{name}", type=float, default=None, help="e.g. 70e9")
    for name in ("layers", "hidden", "kv-heads", "head-dim"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--coolant-delta-t", type=float, default=10.0, help="degrees C")
    parser.add_argument("--network-gbs", type=float, default=50.0,
                        help="prefill-to-decode KV transfer bandwidth, GB/s")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def model_from(args: argparse.Namespace) -> catalog.ModelSpec:
    base = catalog.model(args.model)
    overrides = {
        field: getattr(args, field)
        for field in ("total_params", "active_params", "layers", "hidden", "kv_heads", "head_dim")
        if getattr(args, field) is not None
    }
    if "total_params" in overrides and "active_params" not in overrides and not base.is_moe:
        overrides["active_params"] = overrides["total_params"]
    return catalog.custom_model(base, name=base.name if not overrides else f"{base.name}*",
                                **overrides)  # fmt: skip


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(
        users=args.users,
        tps_per_user=args.tps_per_user,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        ttft_slo_ms=args.ttft_slo_ms,
        itl_slo_ms=args.itl_slo_ms,
        prefix_hit_rate=args.prefix_hit_rate,
    )


def plan_from(args: argparse.Namespace) -> Plan:
    return make_plan(
        model_from(args),
        catalog.hardware(args.gpu),
        workload_from(args),
        weights_dtype=args.weights_dtype,
        kv_dtype=args.kv_dtype,
        settings=PlanSettings(coolant_delta_t_c=args.coolant_delta_t, network_gbs=args.network_gbs),
    )


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from(args)
    except (PlanError, ValueError, FileNotFoundError) as exc:
        print(f"tokenyard plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        show(plan)
    return 0


def show(plan: Plan) -> None:
    table = Table(title=f"{plan.model} on {plan.hardware} ({plan.weights_dtype} weights)")
    table.add_column("")
    table.add_column("", justify="right")
    mem = plan.memory_per_gpu_gb
    rows = [
        ("parallelism (tp x pp, ep)", f"{plan.tp} x {plan.pp}, ep {plan.ep}"),
        ("memory per GPU: weights / KV / buffers",
         f"{mem['weights']:.1f} / {mem['kv']:.1f} / {mem['buffers']:.1f} GB"),
        ("KV capacity per replica", f"{plan.kv_capacity_tokens:,} tokens, "
                                    f"{plan.kv_capacity_seqs:,} conversations"),
        ("decode batch, inter-token latency", f"{plan.decode_batch}, {plan.decode_itl_ms:.1f} ms"),
        ("decode tok/s per replica", f"{plan.decode_tok_s_per_replica:,.0f}"),
        ("prefill tok/s per replica", f"{plan.prefill_tok_s_per_replica:,.0f}"),
        ("requests/s", f"{plan.requests_per_s:,.1f}"),
        ("replicas: prefill : decode", f"{plan.prefill_replicas} : {plan.decode_replicas}"),
        ("TTFT (queue + prefill + hand-off)", f"{plan.ttft_ms:,.0f} ms"),
        ("GPUs, nodes, racks", f"{plan.gpus_total:,}, {plan.nodes:,}, {plan.racks:,}"),
        ("IT / facility power", f"{plan.it_power_kw:,.1f} / {plan.facility_power_kw:,.1f} kW"),
        ("coolant flow", f"{plan.coolant_flow_lpm:,.0f} L/min"),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
