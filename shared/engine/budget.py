"""The memory budget: how much of its device an engine may take, and what its KV pool gets
of it once the weights and the step's buffers are in.

vLLM sizes a GPU's KV pool from `gpu_memory_utilization`; a CPU engine does the same with
`cpu_memory_utilization`, a share of the host's memory (of its cgroup's limit, in a
container), because at 0.5B-1B shapes the weights with their dense and packed copies, the
KV pool and the activations compete for the same RAM:

    host total x cpu_memory_utilization                       (this engine's share)
    |<- weights ->|<- buffers ->|<------- KV pool ------->|
     measured      activations    what is left, in whole      never more than is
     after load    + RoPE tables  blocks                      free on the host now

Without a utilization a CPU pool is `kv_cache_bytes`, or 512 MiB. Pure arithmetic and
/proc reads: no torch, so the worker imports MemoryBudgetError at no cost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tokenyard.engine.config import EngineConfig

MIB = 1024**2
GIB = 1024**3
DEFAULT_CPU_KV_BYTES = 512 * MIB
MIN_KV_BLOCKS = 2  # one sequence's block and one to grow into

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63


class MemoryBudgetError(ValueError):
    """The model, its buffers and a KV pool of MIN_KV_BLOCKS blocks do not fit the memory the
    engine may use: a restart would fail the same way (workers exit CONFIG_EXIT)."""


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes of the device (a host: RAM, or its cgroup's limit where lower)
    free: int  # bytes free now (a host: MemAvailable, or its cgroup's limit less its use)


def host_memory() -> DeviceMemory:
    """This host's memory as this process may use it: /proc/meminfo, bounded by the
    tightest memory limit of the process's cgroup and its ancestors (a container's)."""
    total, available = parse_meminfo(Path("/proc/meminfo").read_text())
    try:
        limited = cgroup_memory(Path("/proc/self/cgroup").read_text())
    except OSError:
        limited = None
    if limited is not None:
        limit, used = limited
        total, available = min(total, limit), min(available, max(0, limit - used))
    return DeviceMemory(total=total, free=available)


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo's text."""
    values = dict(re.findall(r"^(\w+):\s+(\d+) kB$", text, re.MULTILINE))
    return int(values["MemTotal"]) * 1024, int(values["MemAvailable"]) * 1024


def cgroup_memory(self_cgroup: str, root: Path = _CGROUP_ROOT) -> tuple[int, int] | None:
    """(limit, in use) of the tightest memory limit among the process's cgroup (as
    /proc/self/cgroup's text names it) and its ancestors, or None where none is set.

    In use is the working set as the kubelet counts it: usage less inactive file pages,
    which the kernel reclaims before it would kill anything."""
    tightest: tuple[int, int] | None = None
    for folder, files in _cgroup_folders(self_cgroup, root):
        limit = _read_int(folder / files[0])
        if limit is None or limit >= _UNLIMITED:
            continue
        usage = _read_int(folder / files[1]) or 0
        used = max(0, usage - _stat(folder / "memory.stat", files[2]))
        if tightest is None or limit - used < tightest[0] - tightest[1]:
            tightest = (limit, used)
    return tightest


_V2_FILES = ("memory.max", "memory.current", "inactive_file")
_V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _cgroup_folders(self_cgroup: str, root: Path) -> list[tuple[Path, tuple[str, str, str]]]:
    """The existing cgroup folders of the process's memory controller, itself first, then
    each ancestor up to the hierarchy's root."""
    found = []
    for line in self_cgroup.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2's unified hierarchy
            mount, files = root, _V2_FILES
        elif "memory" in controllers.split(","):
            mount, files = root / "memory", _V1_FILES
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = mount.joinpath(*parts[:depth])
            if (folder / files[0]).is_file():
                found.append((folder, files))
    return found


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def utilization_of(config: EngineConfig) -> float | None:
    """The share of its device the engine may take: gpu_memory_utilization on a GPU,
    cpu_memory_utilization (None: no budget) on a CPU."""
    if config.device.startswith("cuda"):
        return config.gpu_memory_utilization
    return config.cpu_memory_utilization


def share_of(config: EngineConfig, total: int) -> int | None:
    """This engine's bytes of the device, or None without a budget. A CPU engine's
    tensor- and pipeline-parallel ranks are processes on one host: each rank takes its part
    of the share (on GPUs each rank has a device of its own)."""
    utilization = utilization_of(config)
    if utilization is None:
        return None
    ranks = 1 if config.device.startswith("cuda") else config.world_size
    return int(total * utilization / ranks)


def kv_cache_budget(
    config: EngineConfig,
    *,
    buffers_bytes: int,
    own: int,
    free: int,
    total: int,
    block_nbytes: int = 1,
) -> int:
    """Bytes for the KV pool: ``kv_cache_bytes`` when set (it overrides any budget).

    Else, with a utilization (always on a GPU; on a CPU when cpu_memory_utilization is
    set): the engine's share of the device (share_of), less what it already holds there
    (``own``: its weights as loaded, dense and packed copies included) and its step's
    buffers; and never more than is free now, less the buffers. Two engines on one device
    therefore each take a utilization below 0.5 (`tokenyard up` hands each worker its part).
    Without one, on a CPU: 512 MiB, if that is free.

    MemoryBudgetError when fewer than MIN_KV_BLOCKS blocks of ``block_nbytes`` fit."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    share = share_of(config, total)
    if share is None:
        budget = min(DEFAULT_CPU_KV_BYTES, free - buffers_bytes)
    else:
        budget = min(share - own - buffers_bytes, free - buffers_bytes)
    if budget < MIN_KV_BLOCKS * block_nbytes:
        raise MemoryBudgetError(
            _no_room(config, share, buffers_bytes, own, free, total, block_nbytes)
        )
    return budget


def _no_room(
    config: EngineConfig,
    share: int | None,
    buffers_bytes: int,
    own: int,
    free: int,
    total: int,
    block_nbytes: int,
) -> str:
    """Why no KV pool fits, in figures, and what to change."""
    where = "this host" if config.device == "cpu" else config.device
    held = f"weights {own / MIB:.1f} MiB, activations and tables {buffers_bytes / MIB:.1f} MiB"
    need = f"{MIN_KV_BLOCKS} KV blocks ({MIN_KV_BLOCKS * block_nbytes / MIB:.2f} MiB)"
    if share is None:
        return (
            f"no room for a KV pool on {where}: {free / MIB:.1f} MiB free now, less "
            f"activations and tables {buffers_bytes / MIB:.1f} MiB, holds fewer than {need}; "
            "free memory, or give a smaller kv_cache_bytes"
        )
    name = "gpu" if config.device.startswith("cuda") else "cpu"
    return (
        f"the model does not fit its memory budget on {where}: {name}_memory_utilization "
        f"{utilization_of(config):g} of {total / GIB:.1f} GiB is {share / MIB:.1f} MiB; "
        f"{held}; {free / MIB:.1f} MiB free now: no room left for {need}. Raise "
        f"{name}_memory_utilization, quantize the weights, lower max_num_batched_tokens or "
        "max_num_seqs, or give an explicit kv_cache_bytes"
    )
