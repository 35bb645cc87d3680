"""Block pools in POSIX shared memory, so a peer on the same host copies blocks directly.

The engine allocates its pool with :func:`allocate_shared_pool` (through its pool factory);
the KV-transfer server then advertises the segment's name and a same-host receiver maps it
and copies the blocks it needs, pool to pool, with no serialization.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from tokenyard.kv.layout import KVLayout

# data_ptr of every pool this process allocated -> its segment, so a server handed only the
# tensor can find the name to advertise. Keeping the segment here also keeps it mapped.
_OWNED: dict[int, SharedMemory] = {}
_LOCK = threading.Lock()


def allocate_shared_pool(layout: KVLayout, num_blocks: int) -> tuple[torch.Tensor, str]:
    """A zeroed pool of ``layout.pool_shape(num_blocks)`` backed by shared memory.

    The segment is unlinked when this process exits (or by :func:`free_shared_pool`);
    a peer that still has it mapped keeps reading valid, if stale, memory.
    """
    nbytes = layout.block_nbytes * num_blocks
    shm = SharedMemory(name=f"ty-kv-{uuid.uuid4().hex[:16]}", create=True, size=max(nbytes, 1))
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
    pool = flat.view(layout.torch_dtype).view(layout.pool_shape(num_blocks))
    pool.zero_()
    with _LOCK:
        _OWNED[pool.data_ptr()] = shm
    return pool, shm.name


def shared_pool_name(pool: torch.Tensor) -> str | None:
    """The segment name of a pool made by :func:`allocate_shared_pool` in this process."""
    with _LOCK:
        shm = _OWNED.get(pool.data_ptr())
    return shm.name if shm is not None else None


def free_shared_pool(pool: torch.Tensor) -> None:
    """Unlink the pool's segment; the mapping itself goes with the last tensor using it."""
    with _LOCK:
        shm = _OWNED.pop(pool.data_ptr(), None)
    if shm is not None:
        shm.unlink()


class Attached:
    """A peer's pool mapped into this process (read side)."""

    def __init__(self, name: str, nbytes: int):
        self._shm = SharedMemory(name=name, create=False)
        # NOTE: Python < 3.13 registers attached segments with the resource tracker, which
        # would unlink the owner's pool when *this* process exits. Only the owner unlinks.
        resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        if self._shm.size < nbytes:
            self._shm.close()
            raise ValueError(f"shared memory {name!r} holds {self._shm.size} bytes, not {nbytes}")
        self.bytes: torch.Tensor | None = torch.frombuffer(
            self._shm.buf, dtype=torch.uint8, count=nbytes
        )

    def close(self) -> None:
        self.bytes = None
        # A view still alive somewhere keeps the mapping; it goes with that view.
        with contextlib.suppress(BufferError):
            self._shm.close()
