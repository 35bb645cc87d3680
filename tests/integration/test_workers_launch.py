"""No orphans: `tokenyard up` stops everything on Ctrl-C, and a killed launcher takes its
children with it (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.procs import wait_until

LAUNCHER = """
import json, sys, time
from tokenyard.services.launch.stack import LocalStack, StackConfig
stack = LocalStack(StackConfig(engine="fake", gateway=False, kvcache=False, facilities=False, telemetry=False)).start()
print(json.dumps([[p.name, p.pid] for p in stack.procs]), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent, the launcher, is gone; init reaps it).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_children_die_with_a_killed_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    try:
        named = dict(json.loads(launcher.stdout.readline()))
        pids = list(named.values())
        assert len(pids) == 4 and all(alive(p) for p in pids)  # nats, router, prefill, decode
        # CPU workers keep the launcher's priority; the services beside them run lower
        base = os.getpriority(os.PRIO_PROCESS, launcher.pid)
        nice = {name: os.getpriority(os.PRIO_PROCESS, pid) - base for name, pid in named.items()}
        assert nice == {"nats": 10, "router": 10, "prefill-1": 0, "decode-2": 0}, nice
        launcher.kill()
        launcher.wait()
        assert wait_until(lambda: not any(alive(p) for p in pids), 15), [
            p for p in pids if alive(p)
        ]
    finally:
        launcher.kill()


def test_up_stops_everything_on_ctrl_c(tmp_path):
    port = free_port()
    run_file = tmp_path / "run" / "up.json"
    env = {
        **os.environ,
        "TOKENYARD_WORKER_ENGINE": "fake",
        "TOKENYARD_RUN_FILE": str(run_file),
    }
    env.pop("TOKENYARD_GRPC_TOKEN", None)
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenyard.cli",
            "up",
            "--port",
            str(port),
            "--no-kvcache",
            "--no-facilities",
            "--disaggregated",
            "--console-port",
            "0",
            "--log-dir",
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        banner = "".join(lines)
        assert f"http://127.0.0.1:{port}" in banner and "curl" in banner, banner
        console = re.search(r"^console: (http://127\.0\.0\.1:\d+/) ", banner, re.M)
        assert console, banner
        assert wait_until(lambda: _answers(f"{console[1]}health"), 30)
        kids = children_of(up.pid)
        assert len(kids) == 6  # nats, router, prefill, decode, gateway, telemetry
        _ctl_finds_the_printed_token(banner, run_file, tmp_path / "decode-2.log", env)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert not any(alive(p) for p in kids)
        assert not run_file.exists()  # the token leaves with the stack
    finally:
        up.kill()


def _ctl_finds_the_printed_token(banner: str, run_file, worker_log, env) -> None:
    token = re.search(r"^Control \(gRPC\) token: (\S+)", banner, re.M)
    assert token, banner
    assert json.loads(run_file.read_text())["grpc_token"] == token[1]
    assert run_file.stat().st_mode & 0o777 == 0o600
    found = re.search(r"control on (\S+)", worker_log.read_text())
    assert found, worker_log.read_text()
    argv = [sys.executable, "-m", "tokenyard.cli", "ctl", "worker", "status", found[1]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr  # no --token: ctl read the running up's
    assert json.loads(done.stdout)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
