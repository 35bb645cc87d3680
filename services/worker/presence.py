"""What this worker tells the fleet, and hears of it: heartbeats (with its readiness),
its peers' heartbeats, and its KV events with the dump a router asks for to resync.

KV events are numbered 1, 2, ... within this process's epoch (the router's
tokenyard.services.router.kv_sync): a gap or a new epoch makes it ask for a dump.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from tokenyard.bus import subjects
from tokenyard.bus.nats import Bus
from tokenyard.bus.senders import subscribe_heartbeats
from tokenyard.engine.contract import Engine
from tokenyard.fleet import FleetView
from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.kv.layout import layout_to_proto
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.kv import KVPort
from tokenyard.services.worker.metrics import WorkerMetrics
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.v1 import serving_pb2 as pb

log = logging.getLogger(__name__)

STEP_LOG_S = 10.0  # how often a busy worker logs its step timings
# A KV dump's bytes besides its hashes (ids, epoch, headers): what it leaves of max_payload.
DUMP_OVERHEAD_BYTES = 4096

_KV_EVENT_KINDS = {
    "stored": pb.KVEvent.STORED,
    "removed": pb.KVEvent.REMOVED,
    "cleared": pb.KVEvent.CLEARED,
}


class Presence:
    def __init__(
        self,
        settings: WorkerSettings,
        bus: Bus,
        engine: Engine,
        loop: EngineLoop,
        kv: KVPort,
        metrics: WorkerMetrics,
        *,
        seq_cap: Callable[[], int],
        accepting: asyncio.Event,
    ) -> None:
        """``accepting``: cleared while an operator has drained the worker (control.py)."""
        self.settings = settings
        self.worker_id = settings.worker_id
        self.bus = bus
        self.engine = engine
        self.loop = loop
        self.kv = kv
        self.metrics = metrics
        self.seq_cap = seq_cap
        self.accepting = accepting
        self.fleet = FleetView()  # every worker's heartbeats, ours included
        self.kv_epoch = secrets.token_hex(8)
        self.kv_seq = 0
        self.control_endpoint = ""  # the WorkerControl server, once started
        self.ops_endpoint = ""  # the ops HTTP server (/metrics), set by the service's wiring
        # The measured cost of a KV-cache fetch, set by the prefill handler that fetches.
        self.kvcache_fetch_ms_per_block: Callable[[], float] = lambda: 0.0
        # More reasons the worker may not take work (its work queue's consumer), registered
        # by the role handlers.
        self.readiness_checks: list[Callable[[], str | None]] = []
        self._tokens_at = (time.monotonic(), 0)
        self._step_log_at = time.monotonic()

    async def start(self, tg: asyncio.TaskGroup, stopping: asyncio.Event) -> None:
        """Listen to the fleet, publish KV event 1, and beat until ``stopping``."""
        await subscribe_heartbeats(self.bus, self.on_peer_heartbeat)
        await self.bus.subscribe(
            subjects.kv_resync(self.worker_id), pb.KVResyncRequest, self.on_kv_resync
        )
        await self.publish_kv_events([("cleared", [])])  # event 1: a new process holds nothing
        tg.create_task(self._heartbeats(stopping), name="heartbeats")

    # --- readiness and heartbeats --------------------------------------------------------

    def not_ready(self) -> str | None:
        """Why this worker cannot take work now (None: it can), from what it knows without
        asking anyone: its NATS connection, its engine, its handlers' last checks."""
        if not self.bus.nc.is_connected:
            return "not connected to NATS"
        stuck = self.loop.busy_for(time.monotonic())
        if stuck > self.settings.engine_stall_s:
            return f"the engine has not answered for {stuck:.0f} s"
        for check in self.readiness_checks:
            reason = check()
            if reason is not None:
                return reason
        return None

    async def on_peer_heartbeat(self, hb: pb.WorkerHeartbeat, _msg: Msg | None) -> None:
        self.fleet.on_heartbeat(hb, time.monotonic())

    def peer_alive(self, worker_id: str) -> bool:
        return self.fleet.alive(worker_id, time.monotonic())

    async def heartbeat(self) -> pb.WorkerHeartbeat:
        stats = await self.loop.stats()
        self.metrics.on_stats(stats)
        now, generated = time.monotonic(), self.loop.tokens_generated
        then, before = self._tokens_at
        self._tokens_at = (now, generated)
        fixed_s, per_token_s = self.loop.timing.fit()
        return pb.WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.settings.role,
            model=self.engine.model_id,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_free_blocks=stats.num_free_blocks,
            num_blocks=stats.num_blocks,
            max_num_seqs=self.settings.max_num_seqs,
            seq_cap=self.seq_cap(),
            tokens_per_s=(generated - before) / (now - then) if now > then else 0.0,
            kv_endpoint=self.kv.endpoint,
            host=self.settings.advertised_host,
            sent_unix_ms=int(time.time() * 1000),
            block_size=self.engine.block_size,
            heartbeat_interval_ms=int(self.settings.heartbeat_interval_s * 1000),
            max_model_len=self.engine.max_model_len,
            step_fixed_ms=fixed_s * 1e3,
            step_ms_per_token=per_token_s * 1e3,
            pending_prompt_tokens=stats.num_pending_prompt_tokens,
            local_prefill=self.settings.takes_prefill_jobs and not self.settings.prefills,
            kv_epoch=self.kv_epoch,
            kv_seq=self.kv_seq,
            not_ready=self.not_ready() or "",
            draining=not self.accepting.is_set(),
            control_endpoint=self.control_endpoint,
            ops_endpoint=self.ops_endpoint,
            kv_layout=layout_to_proto(self.engine.layout) if self.engine.layout else None,
            kvcache_fetch_ms_per_block=self.kvcache_fetch_ms_per_block(),
            lora_adapters=sorted(stats.loras),
            lora_room=stats.lora_room,
            lora_paths=stats.lora_paths,
            kvcache_offload_bytes=self.metrics.kv_offload_bytes,
            kvcache_fetch_bytes=self.metrics.kv_fetch_bytes,
        )

    def log_step_timings(self) -> None:
        """Every STEP_LOG_S, what the engine loop did (profiles of a loaded stack read it)."""
        now = time.monotonic()
        if now - self._step_log_at < STEP_LOG_S:
            return
        window = self.loop.timing.take_window()
        if window.steps:
            fixed_s, per_token_s = self.loop.timing.fit()
            log.info(
                "steps: %s; fit %.1f ms + %.2f ms/token",
                window.describe(now - self._step_log_at),
                fixed_s * 1e3,
                per_token_s * 1e3,
            )
        self._step_log_at = now

    async def beat_now(self) -> None:
        """A heartbeat out of turn: what it says changed (a LoRA adapter loaded) and the
        router must know before the next request relies on it."""
        await self.bus.publish(
            subjects.heartbeat(self.settings.role, self.worker_id), await self.heartbeat()
        )

    async def _heartbeats(self, stopping: asyncio.Event) -> None:
        subject = subjects.heartbeat(self.settings.role, self.worker_id)
        while not stopping.is_set():
            try:
                await self.bus.publish(subject, await self.heartbeat())
                self.log_step_timings()
            except Exception:
                log.exception("heartbeat failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.settings.heartbeat_interval_s)

    # --- KV events ------------------------------------------------------------------------

    async def publish_kv_events(self, events: list[tuple[str, list[int]]]) -> None:
        for kind, hashes in events:
            self.kv_seq += 1
            event = pb.KVEvent(
                worker_id=self.worker_id,
                kind=_KV_EVENT_KINDS.get(kind, pb.KVEvent.KIND_UNSPECIFIED),
                block_hashes=hashes,
                hash_version=HASH_SPEC_VERSION,
                seq=self.kv_seq,
                epoch=self.kv_epoch,
            )
            await self.bus.publish(subjects.kv_events(self.worker_id), event)

    async def on_kv_resync(self, req: pb.KVResyncRequest, msg: Msg) -> None:
        """A router lost the thread of our KV events: answer with every block we hold."""
        # NOTE: the seq is read before the engine call. Every event up to it was drained
        # before the dump is taken, so the dump includes it; later events may or may not be
        # in the dump, and the router applies them on top, which ends in the same state.
        seq = self.kv_seq
        hashes = await self.loop.call(self.engine.cached_block_hashes)
        fits = max(0, (self.bus.nc.max_payload - DUMP_OVERHEAD_BYTES) // 8)  # fixed64 each
        dump = pb.KVDump(
            worker_id=self.worker_id,
            epoch=self.kv_epoch,
            seq=seq,
            block_hashes=hashes[-fits:] if fits else [],
            hash_version=HASH_SPEC_VERSION,
            truncated=len(hashes) > fits,
        )
        log.info(
            "KV resync for a router (%s): %d of %d blocks",
            req.reason or "no reason",
            len(dump.block_hashes),
            len(hashes),
        )
        await self.bus.reply(msg, dump)
