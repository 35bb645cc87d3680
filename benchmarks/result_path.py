"""Where a benchmark writes its results when `--out` is not given: outside the repo.

The repo keeps the scripts and only the result files that docs/benchmarks.md and the other
pages cite (benchmarks/results/); every other run goes to `$TOKENYARD_BENCH_RESULTS`, else
~/.cache/tokenyard/bench-results/, one file per run named by script, host and time, so that
runs never overwrite each other and never show up in `git status`.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

ENV_VAR = "TOKENYARD_BENCH_RESULTS"
OUT_HELP = f"default: a new file in ${ENV_VAR}, else in ~/.cache/tokenyard/bench-results/"


def results_dir() -> Path:
    """The folder that takes every run's results unless `--out` names another path."""
    chosen = os.environ.get(ENV_VAR)
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache/tokenyard/bench-results"


def default_out(script: str, suffix: str = ".json") -> Path:
    """`<results_dir>/<script>-<host>-<UTC time><suffix>`, its folder created."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = results_dir() / f"{script}-{socket.gethostname()}-{stamp}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def out_path(given: str | Path | None, script: str) -> Path:
    """`--out` as given (its folder created), else `default_out(script)`."""
    if given is None:
        return default_out(script)
    path = Path(given)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
