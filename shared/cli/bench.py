"""`tokenyard bench serve ...` and `tokenyard bench compare A.json B.json`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenyard.bench import metrics, plots, report, results, workloads
from tokenyard.bench.client import Target
from tokenyard.bench.records import RequestRecord, TokenCounter
from tokenyard.bench.runner import Load, RunResult, run_load

DEFAULT_URL = "http://127.0.0.1:8000"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    _add_serve(sub.add_parser("serve", help="load a server and measure it"))
    compare = sub.add_parser("compare", help="two results files side by side, with ratios")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)


def _add_serve(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--url", default=DEFAULT_URL, help="base URL (with or without /v1)")
    target.add_argument("--model", help="model id; default: the first of GET /v1/models")
    target.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    target.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true so replies run to max_tokens",
    )
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    target.add_argument(
        "--tokenizer",
        help="model file or folder to count tokens with when the server sends no usage "
        "(default: the project's default model)",
    )
    target.add_argument(
        "--extra-body", type=json.loads, default={}, help="JSON merged into every request body"
    )

    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=sorted(workloads.GENERATORS), default="chat")
    work.add_argument("--dataset", type=Path, help="JSONL of {'prompt'|'messages', 'max_tokens'?}")
    work.add_argument("--num-prompts", type=int, default=100, help="measured requests per load")
    work.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--input-len", type=int, default=256, help="median prompt tokens")
    work.add_argument("--output-len", type=int, default=128, help="median max_tokens")
    work.add_argument(
        "--len-sigma", type=float, default=0.6, help="lognormal sigma; 0: fixed lengths"
    )
    work.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix system prompt tokens"
    )
    work.add_argument(
        "--turns", type=int, default=4, help="multi-turn: user turns per conversation"
    )
    work.add_argument("--context-len", type=int, default=4000, help="long-context document tokens")

    load = p.add_argument_group("load (a comma list runs a sweep)")
    load.add_argument("--concurrency", type=_ints, default=[1], help="closed loop, e.g. 1,4,16")
    load.add_argument(
        "--request-rate",
        type=_floats,
        help="open loop, Poisson req/s, e.g. 1,2,4 or inf (overrides --concurrency)",
    )
    load.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")

    slo = p.add_argument_group("SLOs for goodput (per request; ITL: every gap)")
    for name in ("ttft", "itl", "tpot", "e2e"):
        slo.add_argument(f"--slo-{name}-ms", type=float)

    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, help="JSON results file")
    out.add_argument("--plots", type=Path, help="folder for PNG plots (default: beside --out)")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--window-s", type=float, default=1.0, help="throughput-over-time window")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "compare":
        return compare(args.a, args.b)
    return asyncio.run(serve(args))


def compare(path_a: Path, path_b: Path, console: Console | None = None) -> int:
    console = console or Console()
    a, b = results.read(path_a), results.read(path_b)
    for run_a, run_b in report.pair_runs(a["runs"], b["runs"]):
        console.print(report.compare_table(run_a, run_b, f"A: {path_a.name}", f"B: {path_b.name}"))
    return 0


def _loads(args: argparse.Namespace) -> list[Load]:
    if args.request_rate:
        return [
            Load(request_rate=r, max_concurrency=args.max_concurrency) for r in args.request_rate
        ]
    return [Load(concurrency=c) for c in args.concurrency]


def _workload_options(args: argparse.Namespace, num: int, seed: int) -> workloads.WorkloadOptions:
    return workloads.WorkloadOptions(
        num_requests=num, seed=seed, input_len=args.input_len, output_len=args.output_len,
        len_sigma=args.len_sigma, prefix_len=args.prefix_len, turns=args.turns,
        context_len=args.context_len, dataset=args.dataset,
    )  # fmt: skip


async def _default_model(url: str, api_key: str | None) -> str:
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        response = await http.get(f"{base}/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]


async def serve(args: argparse.Namespace, console: Console | None = None) -> int:
    console = console or Console()
    name = "dataset" if args.dataset else args.workload
    try:
        model = args.model or await _default_model(args.url, args.api_key)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        console.print(f"[red]no model id from {args.url}/v1/models ({exc!r}); pass --model[/]")
        return 2
    target = Target(
        url=args.url, model=model, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
        temperature=args.temperature, timeout_s=args.timeout, api_key=args.api_key,
        extra_body=args.extra_body,
    )  # fmt: skip
    try:
        sessions, warm = _sessions(args, name)
    except (ValueError, OSError) as exc:
        console.print(f"[red]workload {name}: {exc}[/]")
        return 2
    slos = metrics.SLOs(args.slo_ttft_ms, args.slo_itl_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    counter = TokenCounter(args.tokenizer)  # shared: the tokenizer loads once, if ever needed
    runs = []
    for load in _loads(args):
        result = await _run_with_progress(target, sessions, load, warm, args, console, counter)
        runs.append(results.run_to_dict(result, slos, args.window_s))
    console.print(report.summary_table(runs, title=f"tokenyard bench: {name} on {model}"))
    config = {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "api_key"
    }
    doc = results.document({**config, "model": model, "workload": name}, runs)
    _write_outputs(doc, args, console)
    return 0 if all(run["summary"]["requests"]["ok"] for run in runs) else 1


def _sessions(
    args: argparse.Namespace, name: str
) -> tuple[list[workloads.Session], list[workloads.Session]]:
    """The measured sessions and the warm-up (first turns only)."""
    sessions = workloads.build(name, _workload_options(args, args.num_prompts, args.seed))
    if not args.warmup:
        return sessions, []
    # NOTE: warm-up prompts come from the next seed, so they never pre-cache a measured prompt.
    warm = workloads.build(name, _workload_options(args, args.warmup, args.seed + 1))
    return sessions, [workloads.Session(s.prelude, s.turns[:1]) for s in warm]


async def _run_with_progress(
    target: Target,
    sessions: list[workloads.Session],
    load: Load,
    warm: list[workloads.Session],
    args: argparse.Namespace,
    console: Console,
    counter: TokenCounter,
) -> RunResult:
    total = sum(len(s.turns) for s in sessions)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("errors {task.fields[errors]}"), TimeElapsedColumn(),
        console=console, disable=args.no_progress, transient=False,
    ) as progress:  # fmt: skip
        task = progress.add_task(load.label, total=total, errors=0)
        errors = 0

        def on_done(record: RequestRecord) -> None:
            nonlocal errors
            errors += not record.ok
            progress.update(task, advance=1, errors=errors)

        return await run_load(
            target,
            sessions,
            load,
            warmup=warm,
            seed=args.seed,
            on_done=on_done,
            counter=counter,
        )


def _write_outputs(doc: dict, args: argparse.Namespace, console: Console) -> None:
    if args.out:
        results.write(args.out, doc)
        console.print(f"results: {args.out}")
    folder = args.plots or (args.out.with_name(args.out.stem + "_plots") if args.out else None)
    if folder:
        for path in plots.write_all(doc, folder):
            console.print(f"plot: {path}")
