"""Settings of the KV-transfer layer (env prefix ``TOKENYARD_KV_TRANSFER_``)."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenyard.kv.transfer.negotiate import TRANSPORTS


class KVTransferSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENYARD_KV_TRANSFER_")

    # Best first; an operator removes what a deployment must not use (e.g. "shm" across
    # containers that share a host id but not /dev/shm).
    allowed: list[str] = Field(default_factory=lambda: list(TRANSPORTS))
    host: str = "127.0.0.1"  # where the sender's gRPC server binds
    # Where peers reach this process (its KV endpoint, its Mooncake engine); empty = the
    # bound address, or this host's own address when bound to 0.0.0.0 (tokenyard.net).
    advertise_host: str = ""
    # The sender frees offered blocks nobody released within this time (dead receiver).
    hold_timeout_s: float = 30.0
    # The receiver gives up on a whole pull after this long (dead or stuck sender).
    timeout_s: float = 10.0
    # ...and on a gRPC stream that delivers nothing for this long.
    stall_timeout_s: float = 3.0
    chunk_bytes: int = 4 << 20
    # Memory transports (shm, mooncake) move bytes without a wire of their own; checking
    # every block's crc32 there costs more than the copy, so it is opt-in.
    verify_memory_transports: bool = False
    mooncake_protocol: str = "tcp"  # "rdma" on an InfiniBand fleet
    mooncake_device: str = ""  # RDMA device names, e.g. "mlx5_0"; empty = auto

    @field_validator("allowed")
    @classmethod
    def _known(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - set(TRANSPORTS))
        if unknown:
            raise ValueError(f"unknown KV transports {unknown}; known: {list(TRANSPORTS)}")
        return value
