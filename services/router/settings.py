"""Router settings (env prefix ``TOKENYARD_ROUTER_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_OPS_PORT = 8091


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_ROUTER_")

    nats_url: str = "nats://127.0.0.1:4222"
    # auto: a cost model over measured step times decides per request (conditional
    # disaggregation); always / never force the choice.
    disaggregation: Literal["auto", "always", "never"] = "auto"
    # kv-aware: prefix overlap and load place a prompt; round-robin: a baseline to compare.
    placement: Literal["kv-aware", "round-robin"] = "kv-aware"
    handoff_fixed_ms: float = 10.0  # the cost model's price of one KV hand-off
    missed_heartbeats: int = 3
    # Place a departed worker's jobs again (tokenyard.bus.orphans), but not this soon after
    # start: until every worker's heartbeat is heard, every worker looks gone.
    orphans_after_s: float = Field(default=5.0, ge=0)
    queue_per_worker: int = 64
    overlap_weight: float = 1.0
    kv_weight: float = 0.5
    # The shared KV-cache service (host:port; "" = none): asked what it holds of each
    # prompt, within kvcache_timeout_s, so placement weighs a pull against a local hit.
    kvcache_endpoint: str = ""
    kvcache_timeout_s: float = Field(default=0.05, gt=0)
    # A shared block's worth as a share of a local one, until workers have measured it.
    shared_hit_value: float = Field(default=0.8, ge=0, le=1)
    # Every holder of a LoRA adapter this busy or more (sequences over cap; 1.0 = every
    # slot taken): a less busy worker with room for an adapter loads it (routing.lora_placement).
    lora_load_busy: float = Field(default=1.0, gt=0)
    log_level: str = "INFO"
    # The ops HTTP server: /health, /ready, /metrics (0 = any free port).
    ops_host: str = "127.0.0.1"
    ops_port: int = Field(default=DEFAULT_OPS_PORT, ge=0, le=65535)
