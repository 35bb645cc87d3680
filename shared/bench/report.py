"""Rich tables: the summary of a run (one column per load) and the side-by-side compare."""

from __future__ import annotations

import math
from typing import Any

from rich.table import Table

# (path into a run dict, label, True when lower is better)
ROWS: list[tuple[str, str, bool | None]] = [
    ("summary.requests.ok", "completed", None),
    ("summary.requests.failed", "failed", True),
    ("summary.duration_s", "duration s", None),
    ("summary.request_throughput", "requests/s", False),
    ("summary.input_token_throughput", "input tok/s", False),
    ("summary.output_token_throughput", "output tok/s", False),
    ("summary.goodput.requests_s", "goodput req/s", False),
    ("summary.goodput.fraction", "met SLOs (share)", False),
    ("summary.energy.output_tokens_per_joule", "output tok/J", False),
    ("summary.energy.output_tokens_per_joule_at_slo", "output tok/J at SLO", False),
    *[
        (f"summary.{m}.{s}", f"{m.removesuffix('_ms').upper()} {s} ms", True)
        for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
        for s in ("mean", "p50", "p90", "p99")
    ],
    ("client.cpu_util", "client CPU (cores)", True),
    ("client.cpu_ms_per_request", "client CPU ms/request", True),
    ("client.cpu_us_per_chunk", "client CPU us/chunk", True),
    ("client.loop_lag_ms.p99", "client loop lag p99 ms", True),
    ("client.send_lag_ms.p99", "send lag p99 ms", True),
]


def lookup(run: dict[str, Any], path: str) -> Any:
    value: Any = run
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _errors(run: dict[str, Any], key: str = "errors") -> str:
    errors = lookup(run, f"summary.{key}") or {}
    return ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "-"


def summary_table(runs: list[dict[str, Any]], title: str = "tokenyard bench") -> Table:
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for run in runs:
        table.add_column(run["label"], justify="right")
    for path, label, _ in ROWS:
        table.add_row(label, *(fmt(lookup(run, path)) for run in runs))
    table.add_row("errors", *(_errors(run) for run in runs))
    table.add_row("server error codes", *(_errors(run, "error_codes") for run in runs))
    table.add_row(
        "tokens counted from", *(fmt(lookup(run, "summary.token_source")) for run in runs)
    )
    table.add_row(
        "energy (usage) from", *(fmt(lookup(run, "summary.energy.sources")) for run in runs)
    )
    return table


def ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or a == 0:
        return None
    return b / a


def compare_table(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str) -> Table:
    table = Table(title=f"{a['label']}  vs  {b['label']}")
    for column in ("metric", name_a, name_b, "B/A"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for path, label, lower_better in ROWS:
        va, vb = lookup(a, path), lookup(b, path)
        r = ratio(va, vb)
        text = fmt(r)
        if r is not None and lower_better is not None and r != 1:
            better = (r < 1) == lower_better
            text = f"[{'green' if better else 'red'}]{text}[/]"
        table.add_row(label, fmt(va), fmt(vb), text)
    table.add_row("errors", _errors(a), _errors(b), "")
    return table


def pair_runs(a: list[dict], b: list[dict]) -> list[tuple[dict, dict]]:
    """By label when both files ran the same loads, else by position."""
    by_label = {run["label"]: run for run in b}
    if all(run["label"] in by_label for run in a):
        return [(run, by_label[run["label"]]) for run in a]
    return list(zip(a, b, strict=False))
