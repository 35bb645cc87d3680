"""A gateway process of its own for e2e tests that need other gateway settings."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from tokenyard.bus.embedded import free_port


@dataclass
class GatewayProc:
    url: str
    proc: subprocess.Popen


@contextlib.contextmanager
def gateway_process(nats_url: str, **settings: str) -> Iterator[GatewayProc]:
    """Runs `python -m tokenyard.services.gateway` on a free port until the block ends."""
    port = free_port()
    env = {
        **os.environ,
        "TOKENYARD_GATEWAY_NATS_URL": nats_url,
        "TOKENYARD_GATEWAY_PORT": str(port),
        "TOKENYARD_GATEWAY_LOG_LEVEL": "warning",
    }
    env.update({f"TOKENYARD_GATEWAY_{k.upper()}": v for k, v in settings.items()})
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.services.gateway"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield GatewayProc(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("gateway did not become healthy")
