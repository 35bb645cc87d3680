"""The facilities service's one settings object (environment prefix TOKENYARD_FACILITIES_)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class FacilitiesSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_FACILITIES_")

    nats_url: str = "nats://127.0.0.1:4222"
    # Empty: a SQLite file under data_dir. Otherwise any SQLAlchemy URL
    # (postgresql+psycopg://user@host:5432/db).
    db_url: str | None = None
    data_dir: Path = Path(".tokenyard")
    # Required: which racks exist and which workers run on them.
    inventory_path: Path
    # Empty: the admin (fault injection) endpoints answer 403.
    admin_token: str | None = None

    host: str = "127.0.0.1"
    port: int = Field(default=8095, ge=0, le=65535)  # 0 = any free port
    # The gRPC control API (FacilitiesControl) on `host`; 0 = any free port.
    grpc_port: int = Field(default=50075, ge=0, le=65535)

    tick_s: float = Field(default=1.0, gt=0)  # simulator step and staleness check
    dwell_s: float = Field(default=30.0, ge=0)  # minimum calm time before a milder state
    stale_after_s: float = Field(default=10.0, gt=0)  # no reading this long: derate
    state_heartbeat_s: float = Field(default=5.0, gt=0)  # RackState republished this often
    derate_seq_fraction: float = Field(default=0.5, gt=0, le=1)
    # Used for the derated cap until a rack's workers have sent heartbeats.
    default_max_num_seqs: int = Field(default=8, ge=1)

    # Readings older than this are deleted (hourly), except those behind a state event.
    readings_retention_h: float = Field(default=7 * 24, gt=0)

    simulate: bool = True  # model the racks whose inventory source is "simulator"
    sim_time_constant_s: float = Field(default=20.0, ge=0)
    sim_full_tokens_per_s: float = Field(default=0.0, ge=0)

    # The autoscaler's desired replica counts for an orchestrator (docs/autoscaling.md):
    # GET /v1/autoscale/desired and a KEDA external scaler on scaler_port (0 = any free
    # port; unset = no scaler). "off": neither decides (the route answers 404).
    autoscale_mode: Literal["off", "sla", "power"] = "power"
    autoscale_interval_s: float = Field(default=5.0, gt=0)
    autoscale_min_prefill: int = Field(default=1, ge=0)
    autoscale_max_prefill: int = Field(default=8, ge=0)
    autoscale_min_decode: int = Field(default=1, ge=0)
    autoscale_max_decode: int = Field(default=8, ge=0)
    autoscale_ttft_p99_s: float = Field(default=2.0, gt=0)
    autoscale_itl_p99_s: float = Field(default=0.1, gt=0)
    scaler_port: int | None = Field(default=None, ge=0, le=65535)
