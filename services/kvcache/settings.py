"""Settings of the KV-cache service (env prefix ``TOKENYARD_KVCACHE_``)."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_PORT = 50070
DEFAULT_OPS_PORT = 8093


class KVCacheSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_KVCACHE_")

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0 = any free port (tests)
    ram_bytes: int = 1 << 30
    redis_url: str = ""  # e.g. redis://127.0.0.1:6379/0; empty = no Redis tier
    redis_prefix: str = "ty:kv:"
    redis_ttl_s: int = 24 * 3600
    redis_bytes: int = 4 << 30
    disk_dir: str = ""  # empty = no disk tier
    disk_bytes: int = 16 << 30
    shutdown_grace_s: float = 5.0
    # The ops HTTP server: /health, /ready, /metrics (0 = any free port).
    ops_host: str = "127.0.0.1"
    ops_port: int = DEFAULT_OPS_PORT
