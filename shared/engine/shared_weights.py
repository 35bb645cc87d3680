"""Weights shared between the engines of one host through one read-only shared-memory file.

Two workers of one stack (prefill and decode) load the same model and build byte-identical
tensors: the dense copies, the int4 packs and their scales, the embeddings, the RoPE tables.
Each would hold its own ~600 MiB. Here the first engine writes them into one file under a
shared-memory directory (/dev/shm by default) and every engine, the first too, swaps its
tensors for read-only views of that file, so the pages are resident once and PSS counts
each process's share of them.

The file's name is a hash of what it holds (every tensor's name, dtype, shape and bytes):
an engine built by other code, another model, dtype or quantization hashes differently and
never maps a file it did not build itself. Safety:

- the builder writes a temporary name, fsyncs, then renames: a file under the final name
  is always complete;
- the build runs under an ``flock`` on a lock file, which the kernel drops when a builder
  dies, so a crashed builder never blocks the next one; its temporary file is removed;
- a directory without room (Docker's 64 MiB /dev/shm) or any error writing falls back to
  private memory, with a warning: sharing saves memory, it is never needed to serve;
- the mapping is read-only: a stray in-place write faults instead of corrupting the peers.

Removing the files is the owner's job (``tokenyard up`` gives its workers a directory of
their own and removes it on stop); unlinking a mapped file is safe, its pages live until
the last engine unmaps them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

ALIGN = 4096  # each tensor starts on its own page: SIMD loads and page sharing alike
SUFFIX = ".weights"
# Room left in the directory beyond the file itself, so filling it does not starve others.
HEADROOM_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class _Slot:
    """Where one distinct tensor lives: the places that hold it, and its bytes in the file."""

    places: list[tuple[nn.Module, str, str]]  # (owner, attribute, "param" | "buffer" | "attr")
    tensor: torch.Tensor
    offset: int

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def share_weights(model: nn.Module, directory: str | Path) -> Path | None:
    """Swap ``model``'s CPU tensors for views of the shared file in ``directory`` (building
    the file if no engine has yet) -> the file's path, or None where they stay private."""
    slots, size = _layout(model)
    if not slots:
        return None
    directory = Path(directory)
    path = directory / f"{_content_key(slots)}{SUFFIX}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            with _locked(directory / f"{path.name}.lock"):
                if not path.exists():
                    if not _has_room(directory, size):
                        return None
                    _write(path, slots, size)
        _map(path, slots, size)
    except OSError as e:
        log.warning(
            "weights stay in private memory: sharing them under %s failed: %s", directory, e
        )
        return None
    log.info("weights shared: %.1f MiB mapped from %s", size / 1024**2, path)
    return path


def _layout(model: nn.Module) -> tuple[list[_Slot], int]:
    """Every distinct CPU tensor of the model, in a fixed order, at aligned offsets."""
    slots: dict[int, _Slot] = {}  # by storage address: tied weights are one slot
    offset = 0
    for owner, attr, kind, t in _tensors(model):
        if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
            continue
        key = t.data_ptr()
        if (
            key in slots
            and slots[key].tensor.shape == t.shape
            and slots[key].tensor.dtype == t.dtype
        ):
            slots[key].places.append((owner, attr, kind))
            continue
        if key in slots:
            continue  # a different view of one storage: rare; it stays private
        slots[key] = _Slot([(owner, attr, kind)], t, offset)
        offset += -(-slots[key].nbytes // ALIGN) * ALIGN
    return list(slots.values()), offset


def _tensors(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    for _name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                yield module, attr, "param", p
        for attr, b in module._buffers.items():
            if b is not None:
                yield module, attr, "buffer", b
        # RoPE keeps its tables as plain attributes (they stay fp32 when the model is cast).
        for attr in ("cos", "sin"):
            t = module.__dict__.get(attr)
            if isinstance(t, torch.Tensor):
                yield module, attr, "attr", t


def _content_key(slots: list[_Slot]) -> str:
    h = hashlib.sha256()
    for s in slots:
        h.update(f"{s.offset}:{s.tensor.dtype}:{tuple(s.tensor.shape)};".encode())
        h.update(_bytes_of(s.tensor))
    return h.hexdigest()[:32]


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (any dtype, int4 packs and fp8 too)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _has_room(directory: Path, size: int) -> bool:
    free = shutil.disk_usage(directory).free
    if free < size + HEADROOM_BYTES:
        log.warning(
            "weights stay in private memory: %s has %.0f MiB free, sharing needs %.0f MiB",
            directory,
            free / 1024**2,
            (size + HEADROOM_BYTES) / 1024**2,
        )
        return False
    return True


def _write(path: Path, slots: list[_Slot], size: int) -> None:
    """Write the file under a temporary name, flush it to the file system, rename it into place."""
    # Under the lock, any temporary file of this name is a dead builder's.
    for stale in path.parent.glob(f"{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS while writing a mapping
            for s in slots:
                os.pwrite(fd, _bytes_of(s.tensor), s.offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _map(path: Path, slots: list[_Slot], size: int) -> None:
    """Point every place that held a slot's tensor at its read-only view in the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != size:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {size}")
        buf = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # NOTE: read-only on purpose: torch warns that writing to the tensors is undefined.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for s in slots:
            view = torch.frombuffer(buf, dtype=torch.uint8, count=s.nbytes, offset=s.offset)
            shared = view.view(s.tensor.dtype).view(s.tensor.shape)
            for owner, attr, kind in s.places:
                _replace(owner, attr, kind, shared)


def _replace(owner: nn.Module, attr: str, kind: str, t: torch.Tensor) -> None:
    if kind == "param":
        old = owner._parameters[attr]
        assert old is not None
        owner._parameters[attr] = nn.Parameter(t, requires_grad=old.requires_grad)
    elif kind == "buffer":
        owner._buffers[attr] = t
    else:
        owner.__dict__[attr] = t
