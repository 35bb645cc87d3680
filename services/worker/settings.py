"""Worker settings (env prefix ``TOKENYARD_WORKER_``), shared by prefill, decode and both."""

from __future__ import annotations

import os
import re
import socket
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenyard.engine.spec.config import SpeculativeConfig
from tokenyard.fleet.roles import Role, can_decode, can_prefill
from tokenyard.net import advertise_address, is_wildcard

DEFAULT_OPS_PORT = 8092


def default_worker_id() -> str:
    """hostname-pid, shortened to what a NATS subject token and a consumer name allow."""
    host = socket.gethostname().split(".")[0][:24]
    return sanitize_worker_id(f"{host}-{os.getpid()}")


def sanitize_worker_id(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", value)


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_WORKER_")

    nats_url: str = "nats://127.0.0.1:4222"
    # Copies of the prefill work queue on a NATS cluster; the same as the gateway's.
    jetstream_replicas: int = Field(default=1, ge=1, le=5)
    worker_id: str = Field(default_factory=default_worker_id)
    role: Role = "both"
    model: str | None = None  # a GGUF file or HF folder; None = the default model
    engine: Literal["real", "fake"] = "real"  # fake: a tiny test double, no model (tests only)
    fake_step_s: float = 0.005  # the fake engine's time per step
    dtype: str | None = None
    kv_cache_dtype: str | None = None  # None = EngineConfig's "auto"
    quantization: str | None = (
        None  # None | "int8" | "int4" | "fp8": weight-only (tokenyard.models.quantize)
    )
    deterministic: bool = False  # batch-invariant steps (EngineConfig.deterministic)
    # Speculative decoding, vLLM's speculative_config as JSON, e.g. {"method": "ngram"};
    # decode-capable workers use it (tokenyard.engine.spec), prefill-only ones ignore it.
    speculative: str | None = None
    # LoRA adapters (engine/lora.py): loaded at start as {"name": "PEFT folder", ...} (JSON),
    # and at run time through the gateway's admin API; `enable_lora` without any at start
    # keeps the slots ready for run-time loads.
    enable_lora: bool = False
    lora_modules: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(default=4, ge=1)
    max_lora_rank: int = Field(default=16, ge=1)
    max_cpu_loras: int = Field(default=32, ge=1)
    max_num_seqs: int = 32
    # Jobs taken from the work queue beyond max_num_seqs: they wait in the engine, whose
    # queue admits by priority and shares tokens fairly between tenants (a job left in
    # JetStream is only ever taken in arrival order). 0 = take only what can run.
    max_queued_jobs: int = Field(default=32, ge=0)
    # The engine's waiting order (engine/fair_queue.py): fair | priority | fcfs.
    scheduling_policy: Literal["fair", "priority", "fcfs"] = "fair"
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int | None = None
    max_model_len: int | None = None
    num_threads: int | None = None  # torch threads; None = torch's default
    device: str = "cpu"  # "cpu", "cuda" or "cuda:<index>"
    gpu_memory_utilization: float = 0.9  # on CUDA: this worker's share of the device
    # On a CPU: this worker's share of the host's memory (weights, buffers, KV pool), which
    # sizes its KV pool unless kv_cache_bytes is set; None = kv_cache_bytes or 512 MiB.
    # `tokenyard up --cpu-memory-utilization` hands each worker on the host its part.
    cpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    # Ranks the model is split over (EngineConfig.tensor_parallel_size); the worker starts
    # the other ranks itself. Its pool then stays out of KV hand-offs (peers recompute).
    tensor_parallel_size: int = 1
    # Pipeline stages (EngineConfig.pipeline_parallel_size), each of tensor_parallel_size
    # ranks; the worker starts them too, and its pool stays out of hand-offs the same way.
    pipeline_parallel_size: int = 1
    # Ranks a Mixture-of-Experts model's experts are placed over, and the placement
    # balancer's spare slots per rank and interval in steps (EngineConfig.expert_*).
    expert_parallel_size: int = 1
    expert_redundant_slots: int = Field(default=0, ge=0)
    expert_rebalance_interval: int = Field(default=0, ge=0)
    heartbeat_interval_s: float = 1.0
    # One engine call (a step, a stats read) running longer than this means the engine is
    # stuck: /ready turns 503 and heartbeats say so, though the process still beats.
    engine_stall_s: float = Field(default=60.0, gt=0)
    # Energy per request (tokenyard.facilities.energy): the modelled draw's TDP per
    # accelerator (None: 700 W per GPU, 65 W for a CPU) and the hardware counter read around
    # each step (auto: NVML on CUDA, RAPL on a CPU, where readable; none: modelled only).
    energy_tdp_w: float | None = Field(default=None, gt=0)
    energy_counter: Literal["auto", "rapl", "nvml", "none"] = "auto"
    host: str = "127.0.0.1"  # where the KV transfer server listens (0.0.0.0: everywhere)
    # Where other workers reach this one (its KV endpoint). Empty: the bound address, or,
    # bound to 0.0.0.0, this host's own address (tokenyard.net); Kubernetes sets the pod IP.
    advertise_host: str = ""
    kv_port: int = 0  # 0 = any free port
    # The WorkerControl gRPC server (drain, undrain, status) on `host`; 0 = any free port.
    # Its endpoint rides in the heartbeats (control_endpoint).
    control_port: int = Field(default=0, ge=0, le=65535)
    kv_transfer: bool = True  # False: decode workers always recompute the prompt
    # A decode worker also takes whole requests (prefill here, then decode): the router's
    # cost model sends it one when a hand-off from a prefill worker would not pay.
    local_prefill: bool = True
    # Prefill side: keep the KV pool in shared memory, so a decode worker on this host
    # copies blocks straight from it (the "shm" transport) instead of through a socket.
    kv_shared_memory: bool = True
    # A shared-memory directory where the CPU engines of one host share their built weights
    # as one read-only file (tokenyard.engine.shared_weights); empty = private memory.
    shared_weights_dir: str = ""
    # Quantized layers' dense copies for big steps: "auto" (where a model's come to at most
    # 512 MiB), "all" or "none" (EngineConfig.dense_copies).
    dense_copies: Literal["auto", "all", "none"] = "all"
    # Private CPU weights: keep the dense copies in oneDNN's packed layout where that pays
    # (QuantizedLinear.prepack: faster steps, results equal to the bit; docs/benchmarks.md).
    # False: plain tensors.
    prepack_weights: bool = True
    # The shared KV-cache service (host:port); empty = off. Prefill fetches a prompt's
    # cached prefix from it and writes newly computed full blocks through to it.
    kvcache_endpoint: str = ""
    kvcache_timeout_s: float = 5.0
    # Also offload a finished request's reply blocks (the next turn of a chat resends them
    # as its prompt), not only its prompt's.
    kv_offload_replies: bool = True
    # The most bytes per second (on average, bursts of one second) this worker sends to the
    # KV-cache service; blocks over it are dropped and counted
    # (tokenyard:kv_offload_dropped_bytes). 0 = no limit.
    kv_offload_bytes_per_s: float = Field(default=256 * 1024**2, ge=0)
    # Whether the local prefix cache may fill the whole KV pool (all of it resident) rather
    # than reuse its oldest cached block first, with or without a KV-cache service: a prefix
    # fetched back from the service waits for the engine thread twice, so a local hit is
    # much cheaper, at the same resident memory once the pool has filled (docs/benchmarks.md).
    prefix_cache_grows_pool: bool = True
    # Make the KV pool's pages resident at start (with prefix_cache_grows_pool, which fills
    # the pool within a few dozen requests anyway): a never-used block's first write
    # faulted its pages in during a prefill (docs/benchmarks.md).
    prefault_kv_pool: bool = True
    # JetStream: a job unacked this long is redelivered; we send in-progress acks meanwhile.
    job_ack_wait_s: float = 3.0
    job_max_deliver: int = 5
    # How long the prefill worker waits for a decode worker to take a hand-off.
    handoff_timeout_s: float = 2.0
    # Graceful stop: finish in-flight requests for this long, then hand them back / abort.
    drain_timeout_s: float = 15.0
    log_level: str = "INFO"
    # The ops HTTP server: /health, /ready, /metrics (0 = any free port).
    ops_host: str = "127.0.0.1"
    ops_port: int = DEFAULT_OPS_PORT

    @field_validator("worker_id")
    @classmethod
    def _subject_safe(cls, value: str) -> str:
        if not value or sanitize_worker_id(value) != value:
            raise ValueError(f"worker_id {value!r} may hold only letters, digits, '-' and '_'")
        return value

    @field_validator("speculative")
    @classmethod
    def _speculative_parses(cls, value: str | None) -> str | None:
        if value:
            SpeculativeConfig.parse(value)  # a bad config fails at start, with the reason
        return value or None

    @field_validator("advertise_host")
    @classmethod
    def _reachable(cls, value: str) -> str:
        if value and is_wildcard(value):
            raise ValueError(
                f"advertise_host {value!r} is a bind-everywhere address, not one to dial"
            )
        return value

    @property
    def advertised_host(self) -> str:
        """The address in this worker's KV endpoint and heartbeats; never 0.0.0.0."""
        return advertise_address(self.host, self.advertise_host)

    @property
    def prefills(self) -> bool:
        return can_prefill(self.role)

    @property
    def takes_prefill_jobs(self) -> bool:
        """Prefill-capable, or a decode worker that prefills its own requests."""
        return self.prefills or (self.decodes and self.local_prefill)

    @property
    def decodes(self) -> bool:
        return can_decode(self.role)
