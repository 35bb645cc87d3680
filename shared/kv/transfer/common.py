"""Pieces both ends of a KV transfer share: errors, identities, layout messages, byte views."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from prometheus_client import Counter, Histogram

from tokenyard.kv.checksum import crc32
from tokenyard.kv.layout import KVLayout

TRANSFER_BYTES = Counter(
    "tokenyard:kv_transfer_bytes", "KV bytes pulled by this process", ["transport"]
)
TRANSFER_SECONDS = Histogram(
    "tokenyard:kv_transfer_seconds",
    "Time of one successful KV pull, describe to release",
    ["transport"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
TRANSFER_FAILURES = Counter(
    "tokenyard:kv_transfer_failures",
    "KV pulls that failed (the decode side then recomputes), by transport and reason",
    ["transport", "reason"],
)

# Minted once per process import; with the pid it tells a forked child from its parent.
_PROCESS_NONCE = uuid.uuid4().hex[:12]


class KVTransferError(RuntimeError):
    """A pull did not land; the receiver must fall back to recomputing the prefill."""


@dataclass(frozen=True)
class TransferResult:
    transport: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@cache
def host_id() -> str:
    """Equal on two processes exactly when they see the same /dev/shm, which is what the
    "shm" transport needs: the same kernel (boot id) and the same tmpfs mount there (its
    device number). Two containers on one host each get their own /dev/shm unless they
    share an IPC namespace, so they differ; two processes of one host or one container
    match. Without /dev/shm, the hostname and machine id stand in."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        shm_dev = os.stat("/dev/shm").st_dev
    except OSError:
        shm_dev = None
    if boot and shm_dev is not None:
        return f"{boot}:shm{shm_dev}"
    return ":".join([socket.gethostname(), _read("/etc/machine-id"), boot])


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def process_id() -> str:
    return f"{host_id()}:{os.getpid()}:{_PROCESS_NONCE}"


def check_pool(pool: torch.Tensor, layout: KVLayout) -> None:
    """A pool must be the contiguous block-major tensor the layout describes."""
    if pool.dim() != 6 or tuple(pool.shape[1:]) != layout.block_shape:
        raise ValueError(f"pool shape {tuple(pool.shape)} is not {layout.pool_shape(-1)}")
    if pool.dtype != layout.torch_dtype:
        raise ValueError(f"pool dtype {pool.dtype} is not the layout's {layout.dtype}")
    if not pool.is_contiguous() or pool.device.type != "cpu":
        raise ValueError("the KV pool must be a contiguous host-memory tensor")


def pool_bytes(pool: torch.Tensor) -> torch.Tensor:
    """The pool's storage as a flat uint8 view (no copy): block i is
    ``[i * block_nbytes, (i + 1) * block_nbytes)``."""
    return pool.view(-1).view(torch.uint8)


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce a block mapping into (src_start, dst_start, count) runs, so that blocks
    consecutive on both sides move as one copy."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src: Sequence[int], dst: Sequence[int]
) -> None:
    """Pool-to-pool copy of whole blocks, straight from source rows into destination rows.

    Either pool may be any contiguous tensor whose first dimension is the block id (a pool,
    or a peer's pool as flat bytes)."""
    nb = src_pool[0].nbytes
    assert nb == dst_pool[0].nbytes, "pools with different block sizes"
    # NOTE: numpy slice assignment is one single-threaded memcpy per run. torch's copy_
    # splits each run over its intra-op threads and, on a CPU shared with the engine's
    # own threads, waits on every one of them: several times slower under load.
    s_bytes, d_bytes = pool_bytes(src_pool).numpy(), pool_bytes(dst_pool).numpy()
    for s, d, n in block_runs(src, dst):
        d_bytes[d * nb : (d + n) * nb] = s_bytes[s * nb : (s + n) * nb]


def block_crc32(pool: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    flat = pool_bytes(pool).numpy()
    nb = pool[0].nbytes
    return [crc32(flat[i * nb : (i + 1) * nb].data) for i in block_ids]
