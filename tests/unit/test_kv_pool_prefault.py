"""A prefaulted KV pool is resident in full before its first write, and still all zeros.

Residency is read from the kernel (`mincore`), for both kinds of pool a CPU engine makes:
private anonymous memory (`zeroed_pool`) and the shared-memory segment workers use."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import pytest
import torch

from tokenyard.engine import memory
from tokenyard.engine.memory import prefault, zeroed_pool
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.transfer import allocate_shared_pool
from tokenyard.kv.transfer.shm import free_shared_pool

SHAPE = (64, 4, 2, 16, 2, 64)  # 64 blocks of 32 KiB in bf16: 2 MiB, 512 pages


def resident_share(t: torch.Tensor) -> float:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (length + page - 1) // page
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(ctypes.c_void_p(start), length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def layout() -> KVLayout:
    return KVLayout("m", "bfloat16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64)


@pytest.fixture(params=["private", "shared"])
def pool(request):
    if request.param == "private":
        yield zeroed_pool(SHAPE, torch.bfloat16)
        return
    t, _ = allocate_shared_pool(layout(), SHAPE[0])
    yield t
    free_shared_pool(t)


def test_a_new_pool_is_lazily_resident_until_prefaulted(pool):
    assert resident_share(pool) < 0.1
    prefault(pool)
    assert resident_share(pool) == 1.0
    assert not pool.view(torch.uint8).any()


def test_without_populate_every_page_is_written_once(pool, monkeypatch):
    """Kernels before 5.14 refuse MADV_POPULATE_WRITE: a zero byte per page instead."""
    monkeypatch.setattr(memory, "_MADV_POPULATE_WRITE", -1)  # an advice every kernel refuses
    prefault(pool)
    assert resident_share(pool) == 1.0
    assert not pool.view(torch.uint8).any()
