"""The whole serving stack on one machine, each service its own process.

    with LocalStack(StackConfig(port=8000)) as stack:   # NATS, router, workers, gateway
        stack.wait_ready()
        ...

Used by `tokenyard up` and by the end-to-end tests. Children inherit nothing but the
environment: every setting travels as a TOKENYARD_* variable. What each service is told
is here; the rest has a module of its own:

    config.py     StackConfig, StackError
    nats.py       the NATS server and each service's user on it
    placement.py  threads, devices and shared weights of the workers
    group.py      the processes: start, supervise, describe, stop
    redis.py      the Redis behind per-key limits, a supervised child like the others
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import time
import urllib.request
from pathlib import Path

from tokenyard.bus import auth
from tokenyard.bus.embedded import free_port
from tokenyard.grpc_security import OPERATOR, ROUTER, fresh_tokens, peers_text
from tokenyard.services.launch.config import GATEWAY_ID, ConfigError, StackConfig, StackError
from tokenyard.services.launch.group import ServiceGroup
from tokenyard.services.launch.nats import StackNats
from tokenyard.services.launch.placement import Placement
from tokenyard.services.launch.procs import ChildProcess
from tokenyard.services.launch.redis import redis_socket, start_redis
from tokenyard.services.launch.supervise import Supervisor

__all__ = ["ConfigError", "LocalStack", "StackConfig", "StackError", "facilities_inventory"]

# The stack serves without these (workers recompute what the KV-cache service would hold,
# the router treats racks it hears nothing from as stale, nobody watches the console): one
# that keeps crashing is left down and reported. Any other keeps the stack from serving.
OPTIONAL_SERVICES = frozenset({"kvcache", "telemetry", "facilities"})


def facilities_inventory() -> Path:
    """The operator's inventory (TOKENYARD_FACILITIES_INVENTORY_PATH), else the example one
    shipped in a checkout; ConfigError when there is neither."""
    configured = os.environ.get("TOKENYARD_FACILITIES_INVENTORY_PATH")
    path = Path(configured) if configured else _example_inventory()
    if path is None or not path.exists():
        raise ConfigError(
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
        self.nats = StackNats(config, self._tmp, self.log_dir)
        self.placement = Placement(config)
        self.services = ServiceGroup(
            config.restart_policy, self.log_dir, optional=OPTIONAL_SERVICES
        )
        self.workers: list[ChildProcess] = []
        self.worker_roles: dict[str, str] = {}  # worker id -> prefill | decode | both
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
        self.redis: ChildProcess | None = None  # the Redis behind per-key limits, if any
        # A gRPC token per identity (each worker pool's role, the operator); every server is
        # told only their digests (grpc_peers), each caller only its own token.
        self.grpc_tokens = fresh_tokens()
        self.grpc_peers = peers_text(self.grpc_tokens)
        self.shared_weights_dir: Path | None = None  # made by start()
        # Each service's ops HTTP server (/health, /ready, /metrics), by process name.
        self.ops_urls: dict[str, str] = {}

    @property
    def nats_url(self) -> str:
        """The operator's URL (every permission): for tests and tools, never a service."""
        return self.nats.url

    @property
    def grpc_token(self) -> str:
        """The operator's gRPC token (`tokenyard ctl`): the control APIs take no other."""
        return self.grpc_tokens[OPERATOR]

    @property
    def procs(self) -> list[ChildProcess]:
        return self.services.procs

    @property
    def supervisor(self) -> Supervisor:
        return self.services.supervisor

    @property
    def gateway_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    # --- starting ------------------------------------------------------------------------

    def start(self) -> LocalStack:
        try:
            # Before any process starts: a stack that cannot be whole does not start at all.
            inventory = facilities_inventory() if self.config.facilities else None
            self.shared_weights_dir = self.placement.shared_weights_dir()
            if not self.config.nats_url:
                self.services.watch(self.nats.launch(self.placement.side_nice()))
                self.nats.wait_listening()
            self.nats.url = self.nats.url_for(auth.operator())
            self.nats.make_prefill_stream()
            self._start_kvcache()  # before the router and the workers: they are told where
            self._spawn(
                "router",
                "tokenyard.services.router",
                {
                    "TOKENYARD_ROUTER_NATS_URL": self.nats.url_for(auth.router()),
                    "TOKENYARD_ROUTER_OPS_PORT": self._ops_port("router"),
                    **self._router_kvcache_env(),
                    **self.config.router_env,
                },
            )
            if self.config.aggregated:
                for _ in range(self.config.workers):
                    self.add_worker("both")
            else:
                for _ in range(self.config.prefill):
                    self.add_worker("prefill")
                for _ in range(self.config.decode):
                    self.add_worker("decode")
            if inventory is not None:
                self._start_facilities(inventory)
            if self.config.telemetry:
                self._start_telemetry(inventory)
            if self.config.gateway:  # last: its /ready reports on the optional services
                self._start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def add_worker(
        self, role: str, *, env: dict[str, str] | None = None, worker_id: str | None = None
    ) -> ChildProcess:
        """Start one more worker (prefill, decode or both) against this stack's NATS."""
        self._worker_count += 1
        worker_id = worker_id or f"{role}-{self._worker_count}"
        module = "tokenyard.services.decode" if role == "decode" else "tokenyard.services.prefill"
        settings = {
            "TOKENYARD_WORKER_NUM_THREADS": str(self.placement.threads_per_worker()),
            "TOKENYARD_WORKER_NATS_URL": self.nats.url_for(auth.worker(role, worker_id), pool=role),
            "TOKENYARD_WORKER_ROLE": role,
            "TOKENYARD_GRPC_TOKEN": self.grpc_tokens[role],
            "TOKENYARD_GRPC_PEERS": self.grpc_peers,
            "TOKENYARD_WORKER_WORKER_ID": worker_id,
            "TOKENYARD_WORKER_OPS_PORT": self._ops_port(worker_id),
            **({"TOKENYARD_WORKER_ENGINE": self.config.engine} if self.config.engine else {}),
            **({"TOKENYARD_WORKER_MODEL": self.config.model} if self.config.model else {}),
            **(
                {"TOKENYARD_WORKER_KVCACHE_ENDPOINT": self.kvcache_endpoint}
                if self.kvcache_endpoint
                else {}
            ),
            **self.placement.device_env(self._worker_count),
            "TOKENYARD_WORKER_TENSOR_PARALLEL_SIZE": str(self.config.tensor_parallel_size),
            "TOKENYARD_WORKER_EXPERT_PARALLEL_SIZE": str(self.config.expert_parallel_size),
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
        self.worker_roles[worker_id] = role
        return proc

    def worker_role(self, proc: ChildProcess) -> str:
        return self.worker_roles[proc.name]

    def retire_worker(self, worker_id: str) -> ChildProcess:
        """Stop a worker for good (an autoscaler's scale-down): no longer supervised, it gets
        SIGTERM, its graceful stop: it takes nothing new, finishes what it runs, hands back
        what does not finish within its drain timeout, and exits."""
        proc = next(p for p in self.workers if p.name == worker_id)
        self.workers.remove(proc)
        self.services.retire(proc)
        proc.signal(signal.SIGTERM)
        return proc

    def _start_gateway(self) -> None:
        env = {
            "TOKENYARD_GATEWAY_NATS_URL": self.nats.url_for(auth.gateway(GATEWAY_ID)),
            # Its NATS user may read only this prefix's tokens: the two must agree.
            "TOKENYARD_GATEWAY_INSTANCE_ID": GATEWAY_ID,
            "TOKENYARD_GATEWAY_HOST": self.config.host,
            "TOKENYARD_GATEWAY_PORT": str(self.config.port),
            **({"TOKENYARD_GATEWAY_MODEL_PATH": self.config.model} if self.config.model else {}),
            **self._keys_env(),
            # /ready asks the router's rule, under the router's setting.
            "TOKENYARD_GATEWAY_ROUTER_DISAGGREGATION": self.config.router_env.get(
                "TOKENYARD_ROUTER_DISAGGREGATION", "auto"
            ),
            "TOKENYARD_GATEWAY_OPTIONAL_SERVICES": ",".join(
                f"{name}={url}" for name, url in self.optional_health_urls().items()
            ),
            **self.config.gateway_env,
        }
        self._spawn("gateway", "tokenyard.services.gateway", env)

    def optional_health_urls(self) -> dict[str, str]:
        """The /health of each optional service this stack runs, for the gateway's /ready."""
        urls = {
            "kvcache": f"{self.ops_urls['kvcache']}/health" if self.kvcache_endpoint else "",
            "facilities": f"{self.facilities_url}/health" if self.facilities_url else "",
            "telemetry": f"{self.console_url}health" if self.console_url else "",
        }
        return {name: url for name, url in urls.items() if url}

    def _keys_env(self) -> dict[str, str]:
        if not self.config.keys_db_url:
            return {}
        self.redis = start_redis(self._tmp / "redis", self.log_dir, self.placement.side_nice())
        self.services.watch(self.redis)
        return {
            "TOKENYARD_GATEWAY_KEYS_DB_URL": self.config.keys_db_url,
            "TOKENYARD_GATEWAY_REDIS_URL": f"unix://{redis_socket(self._tmp / 'redis')}",
        }

    def _router_kvcache_env(self) -> dict[str, str]:
        if not self.kvcache_endpoint:
            return {}
        return {
            "TOKENYARD_ROUTER_KVCACHE_ENDPOINT": self.kvcache_endpoint,
            "TOKENYARD_GRPC_TOKEN": self.grpc_tokens[ROUTER],
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
                    **kvcache_disk_env(self.config),
                    # It calls no one: it only needs to know its callers.
                    "TOKENYARD_GRPC_TOKEN": "",
                    "TOKENYARD_GRPC_PEERS": self.grpc_peers,
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
            "TOKENYARD_FACILITIES_NATS_URL": self.nats.url_for(auth.facilities()),
            "TOKENYARD_FACILITIES_INVENTORY_PATH": str(inventory),
            "TOKENYARD_FACILITIES_DATA_DIR": str(data),
            "TOKENYARD_FACILITIES_PORT": str(port),
            "TOKENYARD_FACILITIES_GRPC_PORT": str(grpc_port),
            "TOKENYARD_FACILITIES_ADMIN_TOKEN": token,
            "TOKENYARD_GRPC_TOKEN": "",
            "TOKENYARD_GRPC_PEERS": self.grpc_peers,
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
            "TOKENYARD_TELEMETRY_NATS_URL": self.nats.url_for(auth.telemetry()),
            "TOKENYARD_TELEMETRY_DATA_DIR": str(data),
            "TOKENYARD_TELEMETRY_HOST": self.config.host,
            "TOKENYARD_TELEMETRY_PORT": str(port),
            "TOKENYARD_TELEMETRY_ADMIN_TOKEN": token,
            "TOKENYARD_GRPC_TOKEN": self.grpc_token,  # a worker's drain asks for it
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
        """Start a service (nice None: a side service, Placement.side_nice)."""
        nice = self.placement.side_nice() if nice is None else nice
        return self.services.spawn(name, module, env, nice=nice)

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

    def readiness_urls(self) -> dict[str, str]:
        """The /ready of every process this stack started that serves one, by name."""
        urls = {name: f"{url}/ready" for name, url in self.ops_urls.items()}
        if self.facilities_url:
            urls["facilities"] = f"{self.facilities_url}/ready"
        if self.console_url:
            urls["telemetry"] = f"{self.console_url}ready"
        if self.config.gateway:
            urls["gateway"] = f"{self.gateway_url}/ready"
        return urls

    def all_workers_registered(self, body: dict) -> bool:
        live = {w["worker_id"] for w in body.get("workers", [])}
        wanted = {p.name for p in self.workers if p.alive()}
        return wanted <= live

    def check_alive(self) -> None:
        self.services.check_alive()

    def supervise(self) -> list[str]:
        """Restart any service that died (ServiceGroup.supervise); the names restarted."""
        return self.services.supervise()

    def describe_failures(self) -> str:
        return self.services.describe_failures()

    @property
    def down(self) -> dict[str, str]:
        """Optional services given up on (name -> why); the rest of the stack serves."""
        return self.services.down

    # --- stopping ------------------------------------------------------------------------

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stop everything: services first (they drain to NATS), NATS last. keep_logs: a
        temporary log dir stays (a failed start's logs say why)."""
        self.services.stop()
        if self.shared_weights_dir is not None:  # workers still mapping it keep their pages
            shutil.rmtree(self.shared_weights_dir, ignore_errors=True)
        if self.config.log_dir is None and not keep_logs:
            shutil.rmtree(self._tmp, ignore_errors=True)
        elif self.config.log_dir is None:
            for path in self._tmp.iterdir():
                if path.is_dir() and path != self.log_dir:
                    shutil.rmtree(path, ignore_errors=True)
                elif path.is_file():
                    path.unlink()
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


def kvcache_disk_env(config: StackConfig) -> dict[str, str]:
    """The KV-cache service's disk tier, when asked for: a restart over the same directory
    serves what it kept."""
    if not config.kvcache_disk_dir:
        return {}
    return {
        "TOKENYARD_KVCACHE_DISK_DIR": config.kvcache_disk_dir,
        "TOKENYARD_KVCACHE_DISK_BYTES": str(int(config.kvcache_disk_gib * 1024**3)),
    }
