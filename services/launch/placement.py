"""Where a local stack's workers run: their torch threads, their GPU, their shared weights,
and how much lower the services beside them run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tokenyard.services.launch.config import ConfigError, StackConfig

SHARED_MEMORY_DIR = "/dev/shm"


def gpu_placement(
    index: int, num_workers: int, num_gpus: int, utilization: float, tp: int = 1
) -> tuple[str, float]:
    """(device, gpu_memory_utilization) of worker ``index`` (0-based) of ``num_workers``:
    round-robin over groups of ``tp`` GPUs (a tensor-parallel worker's ranks take its first
    GPU and the ``tp - 1`` after it), each group's share split between its workers."""
    if num_gpus < 1:
        raise ConfigError("device cuda asked for, but no CUDA GPU is visible")
    groups = num_gpus // tp
    if groups < 1:
        raise ConfigError(f"--tensor-parallel-size {tp} needs {tp} GPUs; {num_gpus} visible")
    group = index % groups
    sharing = len(range(group, num_workers, groups))
    return f"cuda:{group * tp}", utilization / max(1, sharing)


class Placement:
    def __init__(self, config: StackConfig) -> None:
        self.config = config

    def planned_workers(self) -> int:
        if self.config.aggregated:
            return self.config.workers
        return self.config.prefill + self.config.decode

    def threads_per_worker(self) -> int:
        """Share the cores: torch's default (every core per process) makes N workers on a
        small machine spin against each other and run several times slower."""
        ranks = self.planned_workers() * self.config.ranks_per_worker
        return max(1, (os.cpu_count() or 1) // max(1, ranks))

    def device_env(self, workers_started: int) -> dict[str, str]:
        """The device settings of the newest of ``workers_started`` workers."""
        if self.config.device == "cpu":
            return self._host_memory_env(workers_started)
        import torch

        device, utilization = gpu_placement(
            workers_started - 1,
            max(self.planned_workers(), workers_started),
            torch.cuda.device_count(),
            self.config.gpu_memory_utilization,
            self.config.ranks_per_worker,
        )
        return {
            "TOKENYARD_WORKER_DEVICE": device,
            "TOKENYARD_WORKER_GPU_MEMORY_UTILIZATION": f"{utilization:.4f}",
        }

    def _host_memory_env(self, workers_started: int) -> dict[str, str]:
        """A CPU worker's part of the host's memory budget: the workers share one host.
        NOTE: shared weights (one copy in /dev/shm) are charged to every worker's part in
        full, which errs on the side of smaller KV pools."""
        utilization = self.config.cpu_memory_utilization
        if utilization is None:
            return {}
        share = utilization / max(self.planned_workers(), workers_started)
        return {"TOKENYARD_WORKER_CPU_MEMORY_UTILIZATION": f"{share:.6g}"}

    def shared_weights_dir(self) -> Path | None:
        """A fresh directory under /dev/shm for the workers' shared weights, or None (off,
        on a GPU, one worker, or no /dev/shm: the workers keep private copies). One worker
        has nobody to share with, and its private weights are packed for oneDNN
        (QuantizedLinear.prepack), which shared ones cannot be."""
        shm = Path(SHARED_MEMORY_DIR)
        if not self.config.shared_weights or self.config.device != "cpu" or not shm.is_dir():
            return None
        if self.planned_workers() == 1:
            return None
        return Path(tempfile.mkdtemp(prefix="tokenyard-weights-", dir=shm))

    def side_nice(self) -> int:
        """How much lower the services beside the workers run (StackConfig.side_nice)."""
        return self.config.side_nice if self.config.device == "cpu" else 0
