"""What this machine can do: the CPU's kind and instruction sets, and the GPU's, read once.

Everything that asks "does this CPU multiply bf16 natively", "is there AMX", "which kind
of CPU is this" asks here (as vLLM's `platforms/cpu.py`): the engine's default dtype
(`tokenyard.engine.config.auto_dtype`), the kernels' build cache (`tokenyard.kernels.cpu`),
the planner's calibration key (`tokenyard.planner.cpu`) and the choice of kernel per layer
(`tokenyard.models.kernel_choice`). Capabilities are plain data, so a test can hand any
module another machine's. Low in the import graph: nothing here imports the engine, the
models or the kernels.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from dataclasses import dataclass
from pathlib import Path

# Flags of bf16 dot-product instructions: x86's AVX512-BF16 and AMX, Arm's BF16.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def flags_in(cpuinfo: str) -> set[str]:
    """The first CPU's feature flags in /proc/cpuinfo's text (x86 "flags", Arm "Features")."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def native_bf16_in(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text names a bf16 dot-product instruction set."""
    return bool(flags_in(cpuinfo) & NATIVE_BF16_FLAGS)


@dataclass(frozen=True)
class CpuInfo:
    """A CPU's feature flags and what our engine reads from them."""

    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """bf16 dot-product instructions. Without them a bf16 matmul is emulated at about a
        third of fp32's speed (docs/benchmarks.md)."""
        return bool(self.flags & NATIVE_BF16_FLAGS)

    @property
    def amx(self) -> bool:
        """Intel AMX multiplies bf16 tiles: oneDNN's matmuls, and torch's fused attention
        built on them, then outrun our vector kernels on a step of many rows."""
        return "amx_bf16" in self.flags

    @property
    def avx512(self) -> bool:
        """AVX-512 (our C++ kernels' widest vectors; without it, AVX2's)."""
        return "avx512f" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        """vdpbf16ps: bf16 pair products into fp32 lanes (a Zen 4, a Sapphire Rapids)."""
        return "avx512_bf16" in self.flags

    @property
    def avx512_vnni(self) -> bool:
        """vpdpwssd: int16 pair products into int32 lanes."""
        return "avx512_vnni" in self.flags

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def kind(self) -> str:
        """Which of our engine's kernel families runs here, the key its planner calibration is
        kept under: "amx" (bf16, linear_amx), "avx512_bf16" (bf16, linear_bf16 and
        linear_i16's VNNI tile: a Zen 4), "avx512" (fp32 on AVX-512), "avx2" (fp32, the int16
        kernels), or "other"."""
        if self.amx:
            return "amx"
        for flag, kind in (("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
            if flag in self.flags:
                return kind
        return "other"

    def tag(self) -> str:
        """A short hash of the flags: the C++ kernels are built with -march=native, so a build
        cache shared between machines (a container image) must not hand one CPU another's
        build."""
        text = " ".join(sorted(self.flags)) or platform.machine()
        return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


@functools.cache
def cpu() -> CpuInfo:
    """This CPU, from /proc/cpuinfo read once per process; no flags where it cannot be read."""
    try:
        return CpuInfo(frozenset(flags_in(Path("/proc/cpuinfo").read_text())))
    except OSError:
        return CpuInfo(frozenset())


@dataclass(frozen=True)
class GpuInfo:
    """The CUDA devices torch sees: how many, and the first one's name and compute
    capability ((0, 0) and "" where there is none)."""

    count: int
    name: str = ""
    capability: tuple[int, int] = (0, 0)

    @property
    def available(self) -> bool:
        return self.count > 0

    @property
    def fp8(self) -> bool:
        """fp8 tensor cores (Ada and Hopper: compute capability 8.9 and up)."""
        return self.capability >= (8, 9)


@functools.cache
def gpu() -> GpuInfo:
    """This machine's CUDA devices, asked of torch once per process."""
    import torch

    if not torch.cuda.is_available():
        return GpuInfo(0)
    major, minor = torch.cuda.get_device_capability(0)
    return GpuInfo(torch.cuda.device_count(), torch.cuda.get_device_name(0), (major, minor))
