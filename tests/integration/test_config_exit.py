"""A service that cannot run as configured exits CONFIG_EXIT with one plain line of reason
last on stderr, which the launcher quotes and never restarts (services/launch/supervise.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenyard.lifecycle import CONFIG_EXIT


def run_service(name: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"tokenyard.services.{name}"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
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
