"""Block pools in POSIX shared memory, so a peer on the same host copies blocks directly.

The engine allocates its pool with :func:`allocate_shared_pool` (through its pool factory);
the KV-transfer server then advertises the segment's name and a same-host receiver maps it
and copies the blocks it needs, pool to pool, with no serialization.
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython's shm_open, POSIX only
import atexit
import contextlib
import mmap
import os
import threading
import uuid
import warnings
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
    # NOTE: a new segment reads as zeros already; writing zeros would make every page
    # resident at once instead of as blocks are first used.
    pool = flat.view(layout.torch_dtype).view(layout.pool_shape(num_blocks))
    with _LOCK:
        if not _OWNED:
            atexit.register(_unlink_all)
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


def _unlink_all() -> None:
    """At exit: a pool's name must not outlive its process (a killed process leaves this to
    the resource tracker, where the segment is registered too)."""
    with _LOCK:
        owned = list(_OWNED.values())
        _OWNED.clear()
    for shm in owned:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


class Attached:
    """A peer's pool mapped into this process (read side).

    NOTE: mapped with shm_open + mmap rather than SharedMemory(create=False): on
    Python < 3.13 the latter registers the segment with the resource tracker, which then
    unlinks the owner's pool when this process exits, and unregistering it instead would
    also drop the owner's registration when both share a tracker (spawned children do).
    Only the owner ever unlinks.
    """

    def __init__(self, name: str, nbytes: int):
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDONLY, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"shared memory {name!r} holds {size} bytes, not {nbytes}")
            self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only on purpose: we never write a peer's pool
            warnings.simplefilter("ignore", UserWarning)
            self.bytes: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        self.bytes = None
        # A view still alive somewhere keeps the mapping; it goes with that view.
        with contextlib.suppress(BufferError):
            self._map.close()
