"""The `cpu` hardware entry: this machine's measured memory bandwidth and matmul rate, and
the engine's efficiencies against them, calibrated by `benchmarks/planner_cpu.py`.

The calibration (cpu_calibration.yaml, beside this file) holds, for each kind of CPU it was
measured on (`cpu_kind`: which kernels our engine runs there), what our own engine reached:
- step_overhead_ms: a batch-1 decode step minus the time to read its weights once;
- decode_flops_eff: a 32-sequence decode step's FLOPs over its time, as a share of the
  measured matmul rate in the engine's compute dtype (bf16 where the CPU multiplies bf16
  natively, fp32 elsewhere: `tokenyard.engine.config.auto_dtype`);
- prefill_flops_eff: the same for one 128-token prefill.
and, where the kind has them, the small-batch regime (`small_batch_rows`,
`small_batch_flops_eff`, `dense_dtype`) and AMX's widening rate (`widen_gbs`).
Bandwidth and matmul rate are measured again whenever the entry is built, so a busier or
faster machine shifts the prediction the way it shifts the engine. A kind with no entry of
its own takes the AVX2 machine's, with a warning: its efficiencies are shares of another
kernel family's rates.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

import yaml

from tokenyard import platforms
from tokenyard.planner.catalog import Hardware

log = logging.getLogger(__name__)

CALIBRATION = Path(__file__).with_name("cpu_calibration.yaml")
FALLBACK_KIND = "avx2"


def memory_read_gbs(mib: int = 512, repeats: int = 5) -> float:
    """The best of a few full reads of a buffer far larger than the caches."""
    import torch

    a = torch.ones(mib * 1024**2 // 4)
    a.sum()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def compute_dtype() -> str:
    """The dtype our engine computes in on this CPU by default (`dtype="auto"`)."""
    from tokenyard.engine.config import auto_dtype

    return auto_dtype("cpu")


def matmul_tflops(n: int = 1024, repeats: int = 5, dtype: str | None = None) -> float:
    """The best matmul rate of an n x n x n product in `dtype`, by default the engine's
    compute dtype: timing bf16 on a CPU that emulates it measured a thousandth of the rate
    the engine's fp32 path reaches there."""
    import torch

    kind = getattr(torch, dtype or compute_dtype())
    a = torch.randn(n, n, dtype=kind)
    b = torch.randn(n, n, dtype=kind)
    a @ b
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e12)
    return best


def cpu_kind() -> str:
    """The key this CPU's calibration is kept under: which of our engine's kernel families
    runs here (`tokenyard.platforms.CpuInfo.kind`)."""
    return platforms.cpu().kind


def _read(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def load_calibration(path: Path = CALIBRATION, kind: str | None = None) -> dict:
    """The calibration of this CPU's kind (or `kind`'s); another kind's where it has none."""
    entries = _read(path)
    if not entries:
        raise FileNotFoundError(
            f"no CPU calibration at {path}: run benchmarks/planner_cpu.py to measure one"
        )
    kind = kind or cpu_kind()
    if kind in entries:
        return entries[kind]
    other = FALLBACK_KIND if FALLBACK_KIND in entries else sorted(entries)[0]
    log.warning(
        "no planner calibration for this CPU's kind (%s): using the %s machine's; "
        "run benchmarks/planner_cpu.py here to measure one",
        kind,
        other,
    )
    return entries[other]


def save_calibration(values: dict, path: Path = CALIBRATION, kind: str | None = None) -> None:
    """Write `values` as the calibration of this CPU's kind (or `kind`'s), keeping the others."""
    entries = _read(path)
    entries[kind or cpu_kind()] = values
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "# Written by benchmarks/planner_cpu.py: our engine against the roofline of a machine\n"
            "# of each kind (tokenyard.planner.cpu.cpu_kind), one entry each.\n"
        )
        yaml.safe_dump(entries, f, sort_keys=True)


def physical_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


@functools.cache
def measured() -> tuple[float, float]:
    return memory_read_gbs(), matmul_tflops()


def cpu_hardware(calibration: dict | None = None, *, remeasure: bool = True) -> Hardware:
    cal = calibration if calibration is not None else load_calibration()
    bw, tflops = measured() if remeasure else (cal["memory_read_gbs"], cal["matmul_tflops"])
    return Hardware(
        name="cpu",
        memory_gb=physical_memory_gb(),
        bandwidth_gbs=bw,
        bf16_tflops=tflops,  # the dense rate the engine's dtype reaches (bf16 or fp32)
        fp8_tflops=0.0,
        link_gbs=0.0,
        domain=1,
        tdp_w=cal.get("tdp_w", 65.0),
        per_node=1,
        node_kw=cal.get("node_kw", 0.15),
        rack_kw=cal.get("rack_kw", 10.0),
        cooling="air",
        pue=1.4,
        decode_bw_eff=1.0,  # the bandwidth is itself a measured read, not a datasheet figure
        decode_flops_eff=cal["decode_flops_eff"],
        prefill_flops_eff=cal["prefill_flops_eff"],
        step_overhead_ms=cal["step_overhead_ms"],
        small_batch_rows=cal.get("small_batch_rows", 0),
        small_batch_flops_eff=cal.get("small_batch_flops_eff", 0.0),
        dense_dtype=cal.get("dense_dtype", ""),
        widen_gbs=cal.get("widen_gbs", 0.0),
        memory_utilization=0.5,  # the rest is the OS's and the other services'
        buffer_fraction=0.0,
    )
