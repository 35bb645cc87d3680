"""PNG plots of a results document (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from tokenyard.bench import metrics  # noqa: E402


def _ok(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["records"] if r["ok"] and not r["warmup"]]


def _latencies(run: dict[str, Any]) -> dict[str, list[float]]:
    ok = _ok(run)
    return {
        "TTFT": [r["chunk_ms"][0] for r in ok if r["chunk_ms"]],
        "ITL": [gap for r in ok for gap in metrics.itl_ms(r["chunk_ms"])],
        "E2E": [(r["end_s"] - r["start_s"]) * 1e3 for r in ok],
    }


def latency_cdfs(runs: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for run in runs:
        for ax, values in zip(axes, _latencies(run).values(), strict=True):
            if values:
                ordered = sorted(values)
                ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
                ax.step(ordered, ys, where="post", label=run["label"])
    for ax, name in zip(axes, ("TTFT", "ITL", "E2E"), strict=True):
        ax.set(
            title=f"{name} CDF",
            xlabel="ms",
            ylabel="fraction of requests" if name != "ITL" else "fraction of gaps",
        )
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing to label when every request failed
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def throughput_over_time(runs: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in runs:
        windows = run["throughput_windows"]
        ax.plot(
            [w["t_s"] for w in windows], [w["output_tok_s"] for w in windows], label=run["label"]
        )
    ax.set(
        title="output throughput over time", xlabel="s since first send", ylabel="output tokens/s"
    )
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def goodput_vs_load(runs: list[dict[str, Any]], path: Path) -> None:
    open_loop = runs[0]["load"]["request_rate"] is not None
    key = "request_rate" if open_loop else "concurrency"
    # NOTE: categorical x positions, so an "inf" rate and uneven sweeps still plot evenly.
    xs = list(range(len(runs)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.set_xticks(xs, [f"{run['load'][key]:g}" for run in runs])
    ax.plot(xs, [run["summary"]["request_throughput"] for run in runs], "o-", label="throughput")
    ax.plot(xs, [run["summary"]["goodput"]["requests_s"] for run in runs], "s-", label="goodput")
    ax.set(
        title="goodput vs " + ("request rate" if open_loop else "concurrency"),
        xlabel="offered request rate (req/s)" if open_loop else "concurrency",
        ylabel="completed requests/s",
    )
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(doc: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    runs = doc["runs"]
    paths = [folder / "latency_cdf.png", folder / "throughput_over_time.png"]
    latency_cdfs(runs, paths[0])
    throughput_over_time(runs, paths[1])
    if len(runs) > 1:
        paths.append(folder / "goodput_vs_load.png")
        goodput_vs_load(runs, paths[-1])
    return paths
