"""`tokenyard plan`: how many accelerators, racks and kW a model and a workload need."""

from __future__ import annotations

import argparse
import json
import math
import sys

from rich.console import Console
from rich.table import Table

from tokenyard.planner import catalog
from tokenyard.planner.plan import Plan, PlanError, PlanSettings, Workload, make_plan


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, but not a default of no value ("None")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsFormatter
    parser.add_argument(
        "--model", default="llama-3.1-70b", help=f"a preset: {', '.join(sorted(catalog.MODELS))}"
    )
    parser.add_argument(
        "--gpu",
        default="h100",
        help=f"accelerator: {', '.join([*sorted(catalog.HARDWARE), 'cpu'])}",
    )
    parser.add_argument(
        "--weights-dtype",
        default="bf16",
        choices=sorted(catalog.DTYPE_BYTES),
        help="weights' storage type",
    )
    parser.add_argument(
        "--kv-dtype",
        default="bf16",
        choices=sorted(catalog.DTYPE_BYTES),
        help="KV cache's storage type",
    )
    parser.add_argument(
        "--users",
        type=int,
        default=1000,
        help="concurrent streams: answers being generated at the same moment, "
        "each read at --tps-per-user (not daily users: see --daily-users)",
    )
    parser.add_argument(
        "--daily-users",
        type=int,
        default=None,
        metavar="N",
        help="size for N users a day instead of --users: with "
        "--requests-per-user-day, the busiest hour's concurrent streams "
        "(Little's law: arrivals per second x seconds per answer)",
    )
    parser.add_argument(
        "--requests-per-user-day",
        type=float,
        default=10.0,
        metavar="R",
        help="with --daily-users: requests each user sends a day",
    )
    parser.add_argument(
        "--peak-factor",
        type=float,
        default=2.0,
        help="with --daily-users: the busiest hour's arrivals over the day's mean",
    )
    parser.add_argument(
        "--tps-per-user",
        type=float,
        default=20.0,
        help="output tokens per second each stream must see",
    )
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=256, help="output tokens")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="time to first token")
    parser.add_argument("--itl-slo-ms", type=float, default=0.0, help="0: 1000 / --tps-per-user")
    parser.add_argument(
        "--prefix-hit-rate",
        type=float,
        default=0.0,
        help="share of prompt tokens served from the prefix cache",
    )
    # Explicit parameters override the preset's (or make a model of their own).
    for name in ("total-params", "active-params"):
        parser.add_argument(
            f"--{name}", type=float, default=None, help="e.g. 70e9 (default: the preset's)"
        )
    for name in ("layers", "hidden", "kv-heads", "head-dim"):
        parser.add_argument(f"--{name}", type=int, default=None, help="(default: the preset's)")
    parser.add_argument("--coolant-delta-t", type=float, default=10.0, help="degrees C")
    parser.add_argument("--network-gbs", type=float, default=50.0,
                        help="prefill-to-decode KV transfer bandwidth, GB/s")  # fmt: skip


def concurrent_users(args: argparse.Namespace) -> int:
    """--users, or the concurrent streams that --daily-users send in the busiest hour."""
    if args.daily_users is None:
        return int(args.users)
    if args.daily_users < 1 or args.requests_per_user_day <= 0 or args.peak_factor < 1:
        raise ValueError(
            "--daily-users needs at least 1 user, --requests-per-user-day above 0 and "
            "--peak-factor at least 1"
        )
    arrivals_per_s = args.daily_users * args.requests_per_user_day / 86_400 * args.peak_factor
    answer_s = args.output_len / args.tps_per_user
    return max(1, math.ceil(arrivals_per_s * answer_s))


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
        users=concurrent_users(args),
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
        if args.daily_users is not None:
            print(
                f"{args.daily_users:,} users a day x {args.requests_per_user_day:g} requests, "
                f"busiest hour x{args.peak_factor:g}: {concurrent_users(args):,} concurrent streams"
            )
        show(plan)
    return 0


def show(plan: Plan) -> None:
    table = Table(title=f"{plan.model} on {plan.hardware} ({plan.weights_dtype} weights)")
    table.add_column("")
    table.add_column("", justify="right")
    mem = plan.memory_per_gpu_gb
    rows = [
        ("parallelism (tp x pp, ep)", f"{plan.tp} x {plan.pp}, ep {plan.ep}"),
        ("tokenyard up", " ".join(plan.up_args())),
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
