"""The JSON results file: the config, and per load a summary, client overhead,
throughput over time and every request record (warm-up included, flagged)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenyard.bench import metrics
from tokenyard.bench.runner import RunResult

FORMAT_VERSION = 1


def run_to_dict(result: RunResult, slos: metrics.SLOs, window_s: float = 1.0) -> dict[str, Any]:
    measured = [r for r in result.records if not r.warmup]
    return {
        "label": result.load.label,
        "load": asdict(result.load),
        "summary": metrics.summarize(result.records, slos),
        "client": result.client,
        "throughput_windows": metrics.throughput_windows(measured, window_s),
        "records": [asdict(r) for r in result.records],
    }


def document(config: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": "tokenyard-bench",
        "version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "runs": runs,
    }


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def read(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    if doc.get("format") != "tokenyard-bench":
        raise ValueError(f"{path}: not a tokenyard bench results file")
    return doc
