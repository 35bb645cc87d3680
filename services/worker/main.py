"""Worker wiring: settings, engine, NATS, role handlers, graceful shutdown.

python -m tokenyard.services.prefill            # role prefill
python -m tokenyard.services.decode             # role decode
python -m tokenyard.services.prefill --role both  # aggregated: one worker does both
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from typing import Any

from nats.aio.msg import Msg

from tokenyard.bus import auth, subjects
from tokenyard.bus.nats import Bus
from tokenyard.engine.budget import MemoryBudgetError
from tokenyard.engine.contract import Engine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.fleet.roles import ROLES, Role
from tokenyard.http_server import ReadyFlag, ops_server
from tokenyard.lifecycle import (
    STOP_GRACE_S,
    exit_for_config,
    run_until_signalled,
    settings_or_exit,
)
from tokenyard.models.errors import ModelLoadError
from tokenyard.net import advertise_address, host_endpoint
from tokenyard.services.worker import control, lora
from tokenyard.services.worker.base import WorkerBase
from tokenyard.services.worker.decode import DecodeHandler
from tokenyard.services.worker.engine_loop import engine_thread
from tokenyard.services.worker.prefill import PrefillHandler
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.span_bus import spans_to_bus
from tokenyard.tracing import setup_tracing
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger("tokenyard.worker")
DRAIN_REFUSED = "refused: a drain needs the operator's token (the control API's)"


def shared_pool(layout: Any, num_blocks: int) -> Any:
    from tokenyard.kv.transfer import allocate_shared_pool

    pool, _name = allocate_shared_pool(layout, num_blocks)
    return pool


def build_engine(settings: WorkerSettings) -> tuple[Engine, type[SamplingParams]]:
    """The engine and its SamplingParams class."""
    if settings.engine == "fake":
        from tokenyard.services.worker.fake_engine import FakeEngine

        fake = FakeEngine(max_num_seqs=settings.max_num_seqs, step_s=settings.fake_step_s)
        return fake, SamplingParams
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    optional: dict[str, Any] = {
        "dtype": settings.dtype,
        "kv_cache_dtype": settings.kv_cache_dtype,
        "quantization": settings.quantization,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "kv_cache_bytes": settings.kv_cache_bytes,
        "max_model_len": settings.max_model_len,
        "num_threads": settings.num_threads,
        "deterministic": settings.deterministic or None,
        "prepack_weights": settings.prepack_weights,
        "dense_copies": settings.dense_copies,
        "speculative_config": settings.speculative if settings.decodes else None,
    }
    # A shared-memory pool is host memory: for a CPU engine of one rank only (a
    # tensor-parallel engine's pool holds one rank's heads; its hand-offs pass through a
    # staging pool of every head, itself in shared memory: services/worker/kv.py; an engine
    # in pipeline stages offers no KV to hand-offs at all).
    one_cpu_rank = (
        settings.device == "cpu"
        and settings.tensor_parallel_size == 1
        and settings.pipeline_parallel_size == 1
        and settings.expert_parallel_size == 1  # its config refuses a shared pool
    )
    if one_cpu_rank and settings.prefills and settings.kv_transfer and settings.kv_shared_memory:
        optional["kv_pool_factory"] = shared_pool
    if settings.enable_lora or settings.lora_modules:
        optional |= {
            "enable_lora": True,
            "max_loras": settings.max_loras,
            "max_lora_rank": settings.max_lora_rank,
            "max_cpu_loras": settings.max_cpu_loras,
        }
    optional["prefix_cache_grows_pool"] = settings.prefix_cache_grows_pool
    optional["prefault_kv_pool"] = settings.prefault_kv_pool and settings.prefix_cache_grows_pool
    # NOTE: not under expert parallelism: the placement balancer rewrites experts in place.
    if (
        settings.device == "cpu"
        and settings.shared_weights_dir
        and settings.expert_parallel_size == 1
    ):
        optional["shared_weights_dir"] = settings.shared_weights_dir
    config = EngineConfig(
        model=settings.model,
        max_num_seqs=settings.max_num_seqs,
        scheduling_policy=settings.scheduling_policy,
        device=settings.device,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        cpu_memory_utilization=settings.cpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        expert_parallel_size=settings.expert_parallel_size,
        expert_redundant_slots=settings.expert_redundant_slots,
        expert_rebalance_interval=settings.expert_rebalance_interval,
        **{k: v for k, v in optional.items() if v is not None},
    )
    engine = LLMEngine(config)
    for name, path in settings.lora_modules.items():  # a bad one stops the start, named
        engine.add_lora(name, path)
    return engine, SamplingParams


class Readiness:
    """The worker's /ready: 200 only when it can really take work now. Starting and
    stopping say so; then NATS, the engine (Presence.not_ready) and, asked of JetStream
    live, the consumer its prefill jobs come through."""

    def __init__(self) -> None:
        self.flag = ReadyFlag("loading the model")
        self.worker: WorkerBase | None = None
        self.prefill: PrefillHandler | None = None

    async def __call__(self) -> str | None:
        reason = self.flag()
        if reason is not None or self.worker is None:
            return reason or "starting"
        if reason := self.worker.presence.not_ready():
            return reason
        return await self.prefill.queue.check() if self.prefill is not None else None


async def serve(settings: WorkerSettings, stop: asyncio.Event) -> None:
    # The ops server answers /health while the model loads; /ready once work can come.
    ready = Readiness()
    async with ops_server(settings.ops_host, settings.ops_port, ready=ready) as ops:
        log.info("worker %s ops on %s", settings.worker_id, ops.url)
        ops_endpoint = host_endpoint(advertise_address(ops.host, settings.advertise_host), ops.port)
        await run_worker(settings, stop, ready, ops_endpoint)


async def run_worker(
    settings: WorkerSettings, stop: asyncio.Event, readiness: Readiness, ops_endpoint: str
) -> None:
    ready = readiness.flag
    thread = engine_thread()  # built where it will run: see engine_thread's note
    engine, params_cls = await asyncio.get_running_loop().run_in_executor(
        thread, build_engine, settings
    )
    bus = await Bus.connect(settings.nats_url, name=f"worker-{settings.worker_id}")
    worker = WorkerBase(settings, bus, engine, params_cls, engine_thread=thread)
    prefill = PrefillHandler(worker) if settings.takes_prefill_jobs else None
    readiness.worker, readiness.prefill = worker, prefill
    worker.presence.ops_endpoint = ops_endpoint  # the heartbeats carry it
    # Every role takes hand-offs: a prefill worker is asked only to resume a request whose
    # decode worker died (tokenyard.fleet.resume_candidates), and decodes it as any would.
    decode = DecodeHandler(worker)

    control_server = control.ControlServer(worker)

    async def on_drain(req: pb.DrainRequest, msg: Msg) -> None:
        """An operator's drain over NATS (the ops console): the control API's drain, then
        the graceful stop of SIGTERM. It must show the stack's control token, as a drain
        through the control API must: the NATS permission alone is no admin's word."""
        token = auth.control_token(msg.headers)
        if not control_server.security.may_call(token, "tokenyard.v1.WorkerControl"):
            log.warning("refused a drain over NATS without the control token")
            await bus.reply(msg, pb.DrainReply(accepted=False, message=DRAIN_REFUSED))
            return
        control.drain(worker, req.reason)
        await bus.reply(msg, pb.DrainReply(accepted=True, message="draining, then exiting"))
        stop.set()

    async def on_lora(req: pb.LoRAAdapterRequest, msg: Msg) -> None:
        await bus.reply(msg, await lora.handle(worker, req))

    try:
        async with spans_to_bus(bus, settings.worker_id), asyncio.TaskGroup() as tg:
            await worker.start(tg)
            for handler in (decode, prefill):
                if handler is not None:
                    await handler.start(tg)
            await control_server.start()
            await bus.subscribe(subjects.drain(settings.worker_id), pb.DrainRequest, on_drain)
            await bus.subscribe(subjects.lora(settings.worker_id), pb.LoRAAdapterRequest, on_lora)
            ready.set(None)
            log.info(
                "worker %s (%s, %s) ready; KV endpoint %r",
                settings.worker_id,
                settings.role,
                worker.model_id,
                worker.kv.endpoint,
            )
            await stop.wait()
            ready.set("stopping")
            await shutdown(worker, prefill, decode)
    finally:
        await control_server.stop()
        await bus.close()


async def shutdown(
    worker: WorkerBase, prefill: PrefillHandler | None, decode: DecodeHandler | None
) -> None:
    """Stop taking work, finish what we can, hand back the rest, leave no held blocks."""
    streams = worker.streams
    log.info("worker %s stopping: finishing %d requests", worker.worker_id, len(streams.running))
    # A last heartbeat that says so: nothing new is placed here, and no job moved here.
    worker.accepting.clear()
    with contextlib.suppress(Exception):
        await worker.presence.beat_now()
    worker.stopping.set()
    if prefill is not None:
        await prefill.queue.stop_fetching()  # before any hand-back: none is fetched again
    if decode is not None:
        await decode.stop_taking()
    # What waits its turn here goes back to the queue now: the router places it on a live
    # worker once this one is gone (its heartbeats stop), instead of after the drain.
    handed = await streams.hand_back_waiting()
    if handed:
        log.info("handed back %d requests that had not begun", handed)
    if not await streams.wait_idle(worker.settings.drain_timeout_s):
        log.warning("handing back %d unfinished requests", len(streams.running))
        await worker.handoffs.hand_over_running()  # the hand-offs taken here, to a live peer
        await streams.hand_back_all()
    await asyncio.sleep(0)  # let the job tasks ack or nak
    if prefill is not None:
        await prefill.remove_own_consumer_if_empty()
    await worker.stop()


def parse_role(default: Role) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description="A Tokenyard worker (settings: TOKENYARD_WORKER_* env vars)"
    )
    parser.add_argument("--role", choices=ROLES, help=f"default {default}")
    args = parser.parse_args()
    if args.role:
        return {"role": args.role}
    return {} if "TOKENYARD_WORKER_ROLE" in os.environ else {"role": default}


def main(default_role: Role) -> None:
    settings = settings_or_exit(WorkerSettings, "worker", **parse_role(default_role))
    logging.basicConfig(
        level=settings.log_level,
        format=f"%(asctime)s {settings.role}:{settings.worker_id} %(levelname)s %(message)s",
    )
    setup_tracing(f"worker-{settings.role}")

    try:
        # The drain may take drain_timeout_s, then hand-offs and the bus's own drain.
        grace = settings.drain_timeout_s + STOP_GRACE_S
        run_until_signalled(lambda stop: serve(settings, stop), grace)
    except ModelLoadError as exc:  # a missing or unreadable model: a restart cannot help
        log.exception("cannot load the model")
        exit_for_config(f"worker {settings.worker_id}", f"cannot load the model: {exc}")
    except MemoryBudgetError as exc:  # the model does not fit: neither would it on a restart
        exit_for_config(f"worker {settings.worker_id}", str(exc))
