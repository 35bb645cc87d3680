"""docker-compose.yml's service graph, run as host processes (no container engine here).

Everything comes from `docker-compose config` (the file as compose resolves it): which
services exist, their commands, environment, healthchecks, depends_on conditions and
volumes. What a container would get from its engine, this gives a process instead:

- a network address of its own: each service gets one loopback address (127.a.b.n), the
  name of every compose service in an environment value resolves to that service's address
  (as compose's DNS would), and a bind to 0.0.0.0 binds the service's own address, so
  every service keeps the port compose gives it;
- its volumes: a bind mount's container path becomes the host path, a named volume a fresh
  directory;
- `python` is this interpreter (the image's interpreter, with tokenyard installed).

Redis and PostgreSQL are the host's own services (127.0.0.1, the ports compose uses; the
database is created as the postgres image's POSTGRES_DB would); NATS is the nats-server
binary run with the compose service's own command line.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tokenyard.bus import auth
from tokenyard.bus.embedded import nats_server_binary
from tokenyard.services.launch.procs import ChildProcess

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
HOST_SERVICES = {"redis": 6379, "postgres": 5432}  # served by the host's own daemons
# What `tokenyard nats-config --format env >> .env` gives compose: a password per NATS user.
NATS_PASSWORDS = {
    auth.password_variable(u.name): auth.new_password() for u in auth.deployment_users()
}


def compose_config(*args: str) -> dict:
    """`docker-compose config`, parsed: the file with anchors, interpolation and paths
    resolved, with the NATS passwords an operator keeps in `.env`."""
    return yaml.safe_load(run_compose(*args, "config", env=NATS_PASSWORDS).stdout)


def run_compose(*args: str, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    command = ["docker-compose", "-f", str(COMPOSE_FILE), "--project-directory", str(ROOT)]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        check=check,
        env={**image_environment(), **env},
    )


@dataclass
class Service:
    name: str
    spec: dict
    address: str
    mounts: dict[str, str] = field(default_factory=dict)  # container path -> host path
    proc: ChildProcess | None = None

    @property
    def is_tokenyard(self) -> bool:
        return self.spec.get("image") == "tokenyard:local"


class ComposeHosts:
    def __init__(self, config: dict, *, log_dir: Path) -> None:
        base = f"127.{random.randint(100, 250)}.{random.randint(0, 250)}"
        self.services: dict[str, Service] = {}
        for n, (name, spec) in enumerate(sorted(config["services"].items())):
            if spec.get("profiles"):  # not part of a plain `docker compose up`
                continue
            address = "127.0.0.1" if name in HOST_SERVICES else f"{base}.{n + 2}"
            self.services[name] = Service(name, spec, address)
        self.log_dir = log_dir
        self._volumes = Path(tempfile.mkdtemp(prefix="tokenyard-compose-"))

    # --- what a container would see ------------------------------------------------------

    def translate(self, service: Service, value: str) -> str:
        """A value from the compose file as this host process must read it."""
        for other in self.services.values():
            value = re.sub(rf"(?<![\w.-]){re.escape(other.name)}(?=:\d)", other.address, value)
        value = re.sub(r"(?<![\w.])(0\.0\.0\.0|localhost)(?![\w.])", service.address, value)
        for inside, outside in service.mounts.items():
            value = value.replace(inside, outside)
        return value

    def environment(self, service: Service) -> dict[str, str]:
        env = service.spec.get("environment") or {}
        return {k: self.translate(service, "" if v is None else str(v)) for k, v in env.items()}

    def argv(self, service: Service, argv: list[str]) -> list[str]:
        argv = [self.translate(service, a) for a in argv]
        return [sys.executable, *argv[1:]] if argv and argv[0] == "python" else argv

    def _mount(self, service: Service) -> None:
        for volume in service.spec.get("volumes", []):
            source, target = volume.split(":")[:2]
            if not source.startswith("/"):  # a named volume: a directory of its own
                path = self._volumes / source
                path.mkdir(exist_ok=True)
                source = str(path)
            service.mounts[target] = source

    # --- starting, in depends_on order ---------------------------------------------------

    def start(self, timeout: float = 300) -> ComposeHosts:
        started: set[str] = set()
        while len(started) < len(self.services):
            ready = [
                s
                for s in self.services.values()
                if s.name not in started and set(s.spec.get("depends_on", {})) <= started
            ]
            assert ready, f"depends_on has a cycle among {set(self.services) - started}"
            for service in ready:
                for dep, cond in service.spec.get("depends_on", {}).items():
                    self.wait_for(self.services[dep], cond["condition"], timeout)
                self._start(service)
                started.add(service.name)
        return self

    def _start(self, service: Service) -> None:
        self._mount(service)
        if service.name in HOST_SERVICES:
            if service.name == "postgres":
                create_database(service.spec["environment"]["POSTGRES_DB"])
            return
        if service.is_tokenyard:
            argv = self.argv(service, service.spec["command"])
        else:  # nats: the image's entrypoint with the compose service's own arguments
            argv = [nats_server_binary(), "-a", service.address, "-p", "4222"]
            argv += [self.translate(service, a) for a in service.spec["command"]]
        service.proc = ChildProcess(
            service.name,
            argv,
            env={**image_environment(), **self.environment(service)},
            log_path=self.log_dir / f"{service.name}.log",
            inherit_env=False,
        ).start()

    def wait_for(self, service: Service, condition: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if service.proc is not None and not service.proc.alive():
                raise RuntimeError(f"{service.name} exited:\n{service.proc.log_tail(30)}")
            if condition == "service_started" or self.healthy(service):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{service.name} not healthy after {timeout:.0f} s\n{self.logs()}")

    def healthy(self, service: Service) -> bool:
        """The service's own healthcheck, run as the container would run it."""
        if service.name in HOST_SERVICES:
            return accepts(service.address, HOST_SERVICES[service.name])
        test = service.spec["healthcheck"]["test"]
        assert test[0] == "CMD", test
        argv = self.argv(service, test[1:])
        if argv[0] == "wget":  # the nats image's probe; a plain GET does the same
            return _http_ok(argv[-1])
        result = subprocess.run(argv, capture_output=True, timeout=10)
        return result.returncode == 0

    # --- stopping ------------------------------------------------------------------------

    def logs(self, lines: int = 20) -> str:
        return "\n".join(
            f"--- {s.name}:\n{s.proc.log_tail(lines)}"
            for s in self.services.values()
            if s.proc is not None
        )

    def stop(self) -> None:
        """The Tokenyard services first (they drain to NATS), then NATS."""
        for first in (True, False):
            procs = [s.proc for s in self.services.values() if s.proc and s.is_tokenyard == first]
            for proc in procs:
                proc.signal(15)
            for proc in procs:
                proc.stop(timeout=20)
        shutil.rmtree(self._volumes, ignore_errors=True)


def image_environment() -> dict[str, str]:
    """What the image gives every container (PATH, HOME, ...) and no Tokenyard setting: a
    TOKENYARD_* or OTEL_* variable of the test run must not reach the compose services."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("TOKENYARD_", "OTEL_"))}


def create_database(name: str) -> None:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as db:
        if db.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            db.execute(f'CREATE DATABASE "{name}"')


def accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False
