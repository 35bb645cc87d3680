"""A service that cannot run as configured exits CONFIG_EXIT with one plain line of reason
last on stderr, which the launcher quotes and never restarts (services/launch/supervise.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tokenyard.engine.budget import host_memory
from tokenyard.lifecycle import CONFIG_EXIT


def run_service(name: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"tokenyard.services.{name}"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("service", "variable"),
    [
        ("router", "TOKENYARD_ROUTER_OPS_PORT"),
        ("gateway", "TOKENYARD_GATEWAY_PORT"),
        ("decode", "TOKENYARD_WORKER_OPS_PORT"),
    ],
)
def test_a_bad_setting_exits_config_with_one_line_naming_it(service, variable):
    done = run_service(service, **{variable: "not-a-number"})
    assert done.returncode == CONFIG_EXIT, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"bad setting {variable}" in last
    assert "Traceback" not in last


def test_a_worker_whose_model_is_missing_exits_config(tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    done = run_service(
        "decode",
        TOKENYARD_WORKER_MODEL=str(missing),
        TOKENYARD_WORKER_OPS_PORT="0",
        TOKENYARD_WORKER_NATS_URL="nats://127.0.0.1:1",
    )
    assert done.returncode == CONFIG_EXIT, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "cannot load the model" in last and str(missing) in last


def test_a_worker_whose_model_does_not_fit_its_memory_budget_exits_config():
    # 1e-5 of any host is a few hundred MiB at most: not the default model's 513 MiB of
    # float32 weights
    done = run_service(
        "decode",
        timeout=600,  # it loads the model first, which a busy 2-core host slows a lot
        TOKENYARD_WORKER_CPU_MEMORY_UTILIZATION="0.00001",
        TOKENYARD_WORKER_NUM_THREADS="1",
        TOKENYARD_WORKER_OPS_PORT="0",
        TOKENYARD_WORKER_NATS_URL="nats://127.0.0.1:1",
    )
    assert done.returncode == CONFIG_EXIT, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("worker ") and "does not fit its memory budget on this host" in last
    assert "cpu_memory_utilization 1e-05 of" in last and "Raise cpu_memory_utilization" in last
    assert "Traceback" not in done.stderr


SPLIT = re.compile(
    r"memory: weights (?P<weights>[\d.]+) MiB, KV cache (?P<kv>[\d.]+) MiB = (?P<blocks>\d+) "
    r"blocks / (?P<tokens>\d+) tokens \(\d+ KiB each\), activations and tables "
    r"(?P<buffers>[\d.]+) MiB, free left [\d.-]+ MiB \(budget (?P<budget>[\d.]+) MiB: "
    r"cpu_memory_utilization (?P<utilization>[\d.e-]+)\)"
)


def test_a_worker_prints_its_memory_split_at_start():
    utilization = min(1.0, 2 * 1024**3 / host_memory().total)  # a 2 GiB share
    env = {
        **os.environ,
        "TOKENYARD_WORKER_CPU_MEMORY_UTILIZATION": f"{utilization:.6g}",
        "TOKENYARD_WORKER_PREFAULT_KV_POOL": "0",
        "TOKENYARD_WORKER_NUM_THREADS": "1",
        "TOKENYARD_WORKER_OPS_PORT": "0",
        # The split comes once the engine is built, before the worker connects to NATS.
        "TOKENYARD_WORKER_NATS_URL": "nats://127.0.0.1:1",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenyard.services.decode"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "engine ready" in line:
                break
        found = SPLIT.search(lines[-1])
        assert found is not None, "".join(lines[-20:])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    mib = {k: float(found[k]) for k in ("weights", "kv", "buffers", "budget")}
    assert int(found["tokens"]) == 16 * int(found["blocks"])  # the default block size
    assert abs(mib["budget"] - utilization * host_memory().total / 1024**2) < 1
    # the pool took what weights and buffers left of the budget, to a block
    assert mib["weights"] > 400 and mib["kv"] > 0
    assert mib["budget"] - 1 < mib["weights"] + mib["kv"] + mib["buffers"] <= mib["budget"] + 0.1
