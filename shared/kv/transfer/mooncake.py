"""Mooncake's Transfer Engine as a KV transport (TCP here, RDMA on an InfiniBand fleet).

The receiver READs the sender's blocks straight into its own pool. Both pools are
registered with the engine: RDMA rejects unregistered memory (TCP would not notice, so we
register everywhere and the same code is right on both).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from tokenyard.kv.transfer.common import block_runs

log = logging.getLogger(__name__)


class MooncakeEngine:
    """One process's transfer engine plus the pools registered with it."""

    def __init__(self, host: str, protocol: str, device: str):
        from mooncake.engine import TransferEngine  # optional native dependency

        self._engine = TransferEngine()
        # "P2PHANDSHAKE": peers exchange segment descriptors directly, no metadata server.
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({protocol!r}) returned {rc}")
        self.endpoint = f"{host}:{self._engine.get_rpc_port()}"
        self.protocol = protocol
        self._registered: dict[int, int] = {}  # address -> bytes
        self._lock = threading.Lock()

    def register(self, pool: torch.Tensor) -> None:
        addr, size = pool.data_ptr(), pool.nbytes
        with self._lock:
            if self._registered.get(addr) == size:
                return
            if addr in self._registered:  # same address, new size: a new pool
                self._engine.unregister_memory(addr)
            if self._engine.register_memory(addr, size) != 0:
                raise RuntimeError(f"Mooncake could not register {size} bytes at {addr:#x}")
            self._registered[addr] = size

    def unregister(self, pool: torch.Tensor) -> None:
        with self._lock:
            if self._registered.pop(pool.data_ptr(), None) is not None:
                self._engine.unregister_memory(pool.data_ptr())

    def read_blocks(
        self,
        peer: str,
        peer_pool_address: int,
        dst_pool: torch.Tensor,
        block_nbytes: int,
        src: Sequence[int],
        dst: Sequence[int],
    ) -> None:
        """Blocking: copy peer blocks ``src`` into ``dst_pool[dst]`` (one descriptor per run)."""
        runs = block_runs(src, dst)
        base = dst_pool.data_ptr()
        rc = self._engine.batch_transfer_sync_read(
            peer,
            [base + d * block_nbytes for _, d, _ in runs],
            [peer_pool_address + s * block_nbytes for s, _, _ in runs],
            [n * block_nbytes for _, _, n in runs],
        )
        if rc != 0:
            raise RuntimeError(f"Mooncake batch read from {peer} returned {rc}")


# NOTE: one engine per process on purpose: Mooncake installs a process-wide memory
# allocator per protocol, and a second engine would also cost a second listening port.
_ENGINE: MooncakeEngine | None = None
_FAILED: str | None = None
_INIT_LOCK = threading.Lock()


def process_engine(host: str, protocol: str, device: str = "") -> MooncakeEngine | None:
    """This process's engine, created on first use; None (logged once) if it cannot start."""
    global _ENGINE, _FAILED
    with _INIT_LOCK:
        if _ENGINE is None and _FAILED is None:
            try:
                _ENGINE = MooncakeEngine(host, protocol, device)
                log.info("Mooncake transfer engine (%s) at %s", protocol, _ENGINE.endpoint)
            except Exception as exc:  # ImportError, missing libibverbs, no device...
                _FAILED = f"{type(exc).__name__}: {exc}"
                log.warning("Mooncake transport unavailable: %s", _FAILED)
        return _ENGINE


def unavailable_reason() -> str | None:
    return _FAILED
