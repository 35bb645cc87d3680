"""Energy per request: each engine step's joules, shared among its sequences by tokens.

Two figures, labelled:

- **modelled**: the facilities power model (`simulator.rack_power_kw`) for the worker's
  own accelerators: ``watts = accelerators x tdp_w x utilization``, utilization the batch
  occupancy (running sequences over ``max_num_seqs``), times the step's seconds. The rack's
  fixed draw (fans, CPUs, network) is the rack's, not a request's, and is left out.
- **measured**: a hardware energy counter read before and after the step, where the host
  has one: RAPL (``/sys/class/powercap/intel-rapl:*/energy_uj``, the CPU packages; it counts
  everything those packages ran during the step, other processes included) or NVML (the
  GPU's total energy counter, through pynvml). None where neither can be read.

A step's joules go to the sequences it computed, in proportion to the tokens each computed
(a prefill chunk of 500 tokens takes 500 shares, a decode one), and are handed out with the
sequence's next output (`EnergyLedger.take`); time between steps (idle) is nobody's.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

log = logging.getLogger(__name__)

MeterKind = Literal["auto", "rapl", "nvml", "none"]
RAPL_GLOB = "/sys/class/powercap/intel-rapl:[0-9]*"  # packages only, not their subzones
CPU_TDP_W = 65.0  # the planner's cpu entry when uncalibrated (tokenyard.planner.cpu)
GPU_TDP_W = 700.0  # an H100 SXM: the catalog's default GPU (tokenyard.planner.catalog)


def busy_watts(accelerators: int, tdp_w: float, utilization: float) -> float:
    """The facilities model's draw of one node's accelerators above the rack's fixed draw."""
    return accelerators * tdp_w * min(1.0, max(0.0, utilization))


class EnergyCounter(Protocol):
    """A rising joule count of some hardware (a wrapping counter is unwrapped)."""

    source: str

    def joules(self) -> float: ...


class RaplCounter:
    """The CPU packages' RAPL counters, summed; they wrap at max_energy_range_uj."""

    source = "rapl"

    def __init__(self, zones: list[Path]) -> None:
        self.zones = zones
        self.ranges = [int((z / "max_energy_range_uj").read_text()) for z in zones]
        self._last: list[int] = self._read()
        self._joules = 0.0

    def _read(self) -> list[int]:
        return [int((z / "energy_uj").read_text()) for z in self.zones]

    def joules(self) -> float:
        # Per zone, so that one zone's wrap is undone with its own range.
        now = self._read()
        total = 0
        for i, (prev, cur) in enumerate(zip(self._last, now, strict=True)):
            total += cur - prev if cur >= prev else cur + self.ranges[i] - prev
        self._last = now
        self._joules += total / 1e6
        return self._joules


class NvmlCounter:
    """The GPU's total energy since its driver loaded (millijoules, NVML)."""

    source = "nvml"

    def __init__(self, device_index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self.joules()  # fails here, at start, on a GPU without the counter

    def joules(self) -> float:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3


def rapl_counter() -> RaplCounter | None:
    zones = [Path(p) for p in sorted(glob.glob(RAPL_GLOB))]
    if not zones:
        return None
    try:
        return RaplCounter(zones)
    except OSError as exc:  # present but root-only (the default since 2020's CVE-2020-8694)
        log.info("RAPL counters not readable (%s): energy is modelled only", exc)
        return None


def nvml_counter(device_index: int) -> NvmlCounter | None:
    try:
        return NvmlCounter(device_index)
    except Exception as exc:  # no pynvml, no driver, or a GPU without the counter
        log.info("NVML energy counter not available (%s): energy is modelled only", exc)
        return None


def nvml_index(device: str) -> int:
    """NVML counts the host's GPUs; CUDA only those in CUDA_VISIBLE_DEVICES, renumbered."""
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def open_counter(kind: MeterKind, device: str) -> EnergyCounter | None:
    """The counter for this worker's device: NVML on CUDA, RAPL on a CPU. "auto" settles
    for none where that one cannot be read; a counter asked for by name must be there."""
    if kind == "none":
        return None
    use = kind if kind != "auto" else ("nvml" if device.startswith("cuda") else "rapl")
    counter = nvml_counter(nvml_index(device)) if use == "nvml" else rapl_counter()
    if counter is None and kind != "auto":
        raise RuntimeError(f"the {kind} energy counter cannot be read on this host")
    return counter


@dataclass(frozen=True)
class PowerModel:
    """The worker's accelerators as the facilities model sees them."""

    accelerators: int
    tdp_w: float
    max_num_seqs: int

    @classmethod
    def for_device(cls, device: str, tp: int, max_num_seqs: int, tdp_w: float | None) -> PowerModel:
        default = GPU_TDP_W if device.startswith("cuda") else CPU_TDP_W
        return cls(max(1, tp), tdp_w if tdp_w is not None else default, max(1, max_num_seqs))

    def step_joules(self, seconds: float, num_running: int) -> float:
        return seconds * busy_watts(self.accelerators, self.tdp_w, num_running / self.max_num_seqs)


@dataclass
class Owed:
    """Joules charged to one request and not yet handed out with an output."""

    modelled: float = 0.0
    measured: float | None = None


class EnergyLedger:
    """Per request, the joules of the steps that computed its tokens."""

    def __init__(self, model: PowerModel, counter: EnergyCounter | None) -> None:
        self.model = model
        self.counter = counter
        self.owed: dict[str, Owed] = {}
        self.total_modelled = 0.0
        self.total_measured = 0.0
        self.total_tokens = 0

    @property
    def source(self) -> str:
        """ "measured:<counter>" where a counter is read, else "modelled"."""
        return f"measured:{self.counter.source}" if self.counter is not None else "modelled"

    def read(self) -> float | None:
        return self.counter.joules() if self.counter is not None else None

    def charge(
        self,
        tokens: dict[str, int],
        seconds: float,
        before: float | None = None,
        after: float | None = None,
    ) -> None:
        """One step: `tokens` computed per request in `seconds`; the counter's readings."""
        total = sum(tokens.values())
        if total <= 0:
            return
        modelled = self.model.step_joules(seconds, len(tokens))
        measured = None
        if before is not None and after is not None:
            measured = max(0.0, after - before)
            self.total_measured += measured
        self.total_modelled += modelled
        self.total_tokens += total
        for rid, n in tokens.items():
            owed = self.owed.setdefault(rid, Owed())
            owed.modelled += modelled * n / total
            if measured is not None:
                owed.measured = (owed.measured or 0.0) + measured * n / total

    def take(self, request_id: str) -> Owed:
        """What the request is owed since its last output (or an abort: forgotten)."""
        return self.owed.pop(request_id, None) or Owed()
