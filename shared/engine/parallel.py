"""Tensor-parallel ranks for one engine: rank 0 is the engine's own process, ranks 1..N-1
are processes it spawns, each holding its share of the model and its own KV pool.

    rank 0 (LLMEngine)                         rank r = 1..N-1 (_rank_main)
    scheduler, block manager, sampler          model shard + KV pool of Hkv/N heads
    ModelRunner.run(batch)
      plan = StepPlan(spans, logit rows)
      broadcast(plan)  ---- gloo, pickled ---> plan = receive()
      compute(plan)                            compute(plan)
        forward: all-reduce x 2 per layer <-----> (the same collectives, same order)
        logits:  all-gather of the rows   <----->
      sample on rank 0                         wait for the next plan
    close(): broadcast(None) -------------->   exit

The ranks see the same plan, so they run the same collectives in the same order and never
need to agree on anything else. Collectives run on gloo on a CPU and NCCL on GPUs (rank r
on the device after rank 0's); plans always travel over gloo, on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.model_runner import StepPlan

log = logging.getLogger(__name__)

# Rank 0 waits this long for the other ranks to load the model and join, and a collective
# of the forward pass this long for a rank that does not answer.
JOIN_TIMEOUT = timedelta(minutes=10)
# NOTE: the other ranks wait for the next plan as long as the engine stays idle: a serving
# worker may get no request for hours, and a timed-out wait would kill its ranks.
IDLE_TIMEOUT = timedelta(days=365)


class RankCommand(Protocol):
    """A message between steps that every rank runs on its model in the same order (e.g.
    tokenyard.engine.expert_balance.Rebalance); rank 0 broadcasts it, then runs it too."""

    def run(self, model: nn.Module) -> None: ...


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU, or the r-th GPU after rank 0's."""
    kind, _, index = device.partition(":")
    return device if kind == "cpu" else f"cuda:{int(index or 0) + rank}"


def init_ranks(config: EngineConfig, rank: int, store: dist.Store) -> Any:
    """Join the process group; returns the group that carries the plans (gloo, on the host,
    with no practical timeout)."""
    world = config.world_size
    cuda = config.device.startswith("cuda")
    if cuda:  # NCCL and the collectives' tensors use the current device
        torch.cuda.set_device(torch.device(rank_device(config.device, 0)))
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=JOIN_TIMEOUT
    )
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


class TensorParallelRanks:
    """Rank 0's handle on the other ranks: start them, send each step's plan, stop them."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        world = config.world_size
        # Rank 0 holds the rendezvous store; port 0 lets the OS choose a free port.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False
        )
        self._procs = mp.start_processes(
            _rank_main,
            args=(config, model_path, self._store.port),
            nprocs=world - 1,
            join=False,
            daemon=True,
            start_method="spawn",
        )
        self._wait_until_started(world)
        self.plan_group = init_ranks(config, 0, self._store)
        self._closed = False
        log.info("tensor parallel: %d ranks joined (%s)", world, dist.get_backend())

    def _wait_until_started(self, world: int) -> None:
        """Fail at once, with its exit code, if a rank dies before it reaches the store
        (rank 0 would otherwise wait JOIN_TIMEOUT for it in init_process_group)."""
        keys = [_started(rank) for rank in range(1, world)]
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while not self._store.check(keys):
            for rank, proc in enumerate(self._procs.processes, start=1):
                if not proc.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {proc.exitcode} before "
                        "joining (its error is in the process's stderr)"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not start in {JOIN_TIMEOUT}")
            time.sleep(0.05)

    def broadcast(self, plan: StepPlan | RankCommand | None) -> None:
        dist.broadcast_object_list([plan], src=0, group=self.plan_group)

    def close(self) -> None:
        """Stop the other ranks and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.broadcast(None)
            self._procs.join()
        finally:
            dist.destroy_process_group()

    def abort(self) -> None:
        """Rank 0 failed while the others may wait in a collective: end them, leave."""
        self._closed = True
        for proc in self._procs.processes:
            proc.terminate()
            proc.join()
        dist.destroy_process_group()


def _started(rank: int) -> str:
    return f"tokenyard/tp/started/{rank}"


def _rank_main(index: int, config: EngineConfig, model_path: str, port: int) -> None:
    """A rank other than 0: load the model, keep its share, run every plan it is sent."""
    from tokenyard.engine.memory import build_model_and_pool
    from tokenyard.engine.model_runner import ModelRunner
    from tokenyard.models.loader import load_model

    rank = index + 1
    config = dataclasses.replace(config, device=rank_device(config.device, rank))
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    store = dist.TCPStore(
        "127.0.0.1", port, config.world_size, is_master=False, timeout=JOIN_TIMEOUT
    )
    store.set(_started(rank), "1")
    plan_group = init_ranks(config, rank, store)
    try:
        model, kv_cache, _, _ = build_model_and_pool(load_model(model_path), config, rank=rank)
        runner = ModelRunner(model, kv_cache, config.block_size, config.deterministic)
        while True:
            received: list[StepPlan | RankCommand | None] = [None]
            dist.broadcast_object_list(received, src=0, group=plan_group)
            if received[0] is None:
                break
            if isinstance(received[0], StepPlan):
                runner.compute(received[0])
            else:
                received[0].run(runner.model)
    finally:
        dist.destroy_process_group()
