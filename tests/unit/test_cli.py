"""The `tokenyard` command: every sub-command is there, or the command says what is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenyard import cli


def test_every_sub_command_is_registered(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("generate", "up", "bench"))


def test_a_missing_sub_command_module_is_an_error_not_a_gap(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("tokenyard.services.ghost", "not built"))
    with pytest.raises(SystemExit, match="tokenyard ghost: cannot import tokenyard.services.ghost"):
        cli.main(["generate", "--help"])


def test_up_takes_the_options_the_readme_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    out = capsys.readouterr().out
    for option in (
        "--prefill",
        "--decode",
        "--aggregated",
        "--model",
        "--nats-url",
        "--port",
        "--dtype",
        "--quantization",
        "--no-kvcache",
        "--no-facilities",
        "--log-dir",
    ):
        assert option in out, option


def test_up_without_a_facilities_inventory_says_why_and_starts_nothing(tmp_path):
    missing = tmp_path / "inventory.yaml"
    env = {**os.environ, "TOKENYARD_FACILITIES_INVENTORY_PATH": str(missing)}
    argv = [sys.executable, "-m", "tokenyard.cli", "up", "--port", "0"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"{missing} does not exist" in done.stdout and "--no-facilities" in done.stdout
    assert "Starting Tokenyard" not in done.stdout  # printed once every service is started


def test_up_deterministic_reaches_the_workers():
    import argparse

    from tokenyard.services import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    config = up.config_from(parser.parse_args(["--deterministic"]))
    assert config.worker_env["TOKENYARD_WORKER_DETERMINISTIC"] == "1"
    assert "TOKENYARD_WORKER_DETERMINISTIC" not in up.config_from(parser.parse_args([])).worker_env
    with pytest.raises(SystemExit, match="needs --quantization"):
        up.config_from(parser.parse_args(["--deterministic", "--quantization", "none"]))
