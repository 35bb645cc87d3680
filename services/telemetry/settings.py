"""The telemetry service's one settings object (environment prefix TOKENYARD_TELEMETRY_)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_PORT = 8090


class TelemetrySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_TELEMETRY_")

    nats_url: str = "nats://127.0.0.1:4222"
    # Empty: a SQLite file under data_dir. Otherwise any SQLAlchemy URL
    # (postgresql+psycopg://user@host:5432/db).
    db_url: str | None = None
    data_dir: Path = Path(".tokenyard")
    # The console, the JSON API, /metrics, /health and /ready.
    host: str = "127.0.0.1"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)  # 0 = any free port
    # Racks -> nodes -> workers come from the facilities inventory; without one, every
    # worker is shown under its host.
    inventory_path: Path | None = None
    # Where the console's admin actions go (fault injection), with the facilities admin token.
    facilities_url: str | None = None
    facilities_admin_token: str | None = None
    # The console's admin actions (inject/clear a fault, drain a worker) need this token;
    # empty: they answer 403.
    admin_token: str | None = None

    retention_h: float = Field(default=24.0, gt=0)  # rows older than this are deleted
    sample_every_s: float = Field(default=2.0, gt=0)  # fleet and rack history resolution
    push_every_s: float = Field(default=1.0, gt=0)  # live updates to open consoles
    window_s: float = Field(default=60.0, gt=0)  # the window of live percentiles and rates
    missed_heartbeats: int = Field(default=3, ge=1)
    log_level: str = "INFO"
