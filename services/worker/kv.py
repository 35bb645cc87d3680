"""The worker's end of the KV hand-off, over tokenyard.kv.transfer.

Prefill side: :meth:`KVPort.offer` holds a prefilled request's blocks for a decode worker to
pull; the transfer layer ends the hold (pulled, aborted or timed out) and the blocks go back
to the engine. Decode side: :meth:`KVPort.pull` copies them into freshly imported blocks.
With no pool to share (a fake engine, or ``kv_transfer=False``) there is no endpoint and
decode workers recompute the prompt instead: same call sites, slower but correct.

Blocks travel with every KV head (``engine.layout``), so workers of any tensor-parallel
sizes exchange them. A tensor-parallel engine's own pool holds one rank's heads: its blocks
pass through a :class:`StagingPool`, gathered from its ranks when offered and split over
them once pulled (``read_kv_blocks`` / ``write_kv_blocks``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class KVPort:
    def __init__(self, loop: EngineLoop, settings: WorkerSettings) -> None:
        self.loop = loop
        self.settings = settings
        self.endpoint = ""
        self._server: Any = None
        self._client: Any = None
        self._releases: set[asyncio.Task[None]] = set()
        self._staging: Any = None  # a StagingPool, for an engine whose pool is not served
        self._staged: dict[str, list[int]] = {}  # offered request -> its staging blocks

    @property
    def enabled(self) -> bool:
        return self.settings.kv_transfer and self.loop.engine.layout is not None

    async def start(self) -> None:
        engine = self.loop.engine
        pool, layout = engine.kv_cache, engine.layout
        if not self.settings.kv_transfer or layout is None:
            return
        from tokenyard.kv.transfer import KVTransferClient, KVTransferServer

        if pool is None:  # tensor parallel: every rank holds its heads' share
            from tokenyard.kv.transfer.staging import StagingPool

            # As many blocks as the engine's pool: an offer or a pull never waits for room.
            num_blocks = (await self.loop.call(engine.stats)).num_blocks
            shm = self.settings.prefills and self.settings.kv_shared_memory
            self._staging = StagingPool(layout, num_blocks, shared_memory=shm)
            pool = self._staging.pool

        if self.settings.prefills:
            self._server = KVTransferServer(
                pool,
                layout,
                on_release=self._on_release,
                host=self.settings.host,
                advertise_host=self.settings.advertised_host,
                port=self.settings.kv_port,
            )
            self.endpoint = await self._server.start()
        if self.settings.decodes:
            self._client = KVTransferClient(
                pool, layout, advertise_host=self.settings.advertised_host
            )

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._server is not None:
            await self._server.stop()
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    @property
    def num_held(self) -> int:
        """Prefilled requests whose blocks wait here for a decode worker's pull."""
        return 0 if self._server is None else len(self._server.holds)

    async def offer(self, request_id: str, block_ids: list[int]) -> tuple[str, list[int]]:
        """Hold the blocks for a pull; returns the endpoint, or "" (then release them
        yourself), and the block ids a puller names (staging blocks for a tensor-parallel
        engine, else the engine's own)."""
        if self._server is None:
            return "", block_ids
        if self._staging is not None:
            staged = await self._stage(request_id, block_ids)
            if staged is None:
                return "", block_ids
            block_ids = staged
        self._server.offer(request_id, block_ids)
        return self.endpoint, block_ids

    async def _stage(self, request_id: str, block_ids: list[int]) -> list[int] | None:
        """Copy a held prefill's blocks (every rank's heads) into staging blocks of its own."""
        ids = self._staging.take(len(block_ids))
        if ids is None:
            log.warning("KV offer of %s: no room to stage %d blocks", request_id, len(block_ids))
            return None
        try:
            self._staging.write(
                ids, await self.loop.call(self.loop.engine.read_kv_blocks, block_ids)
            )
        except BaseException:
            self._staging.give_back(ids)
            raise
        self._staged[request_id] = ids
        return ids

    async def end_hold(self, request_id: str, why: str) -> None:
        """Free a request's held blocks now (nobody will pull them)."""
        if self._server is None or not self._server.end_hold(request_id, why):
            await self.loop.call(self.loop.engine.release, request_id)

    async def pull(self, endpoint: str, request_id: str, src: list[int], dst: list[int]) -> bool:
        """True when ``dst`` now holds the prompt's KV; False means: recompute."""
        if self._client is None or not endpoint:
            return False
        if len(src) != len(dst):
            log.warning(
                "KV pull %s: %d source blocks for %d destination blocks; recomputing",
                request_id,
                len(src),
                len(dst),
            )
            return False
        try:
            if self._staging is None:
                await self._client.pull(endpoint, request_id, src, dst)
            else:
                await self._pull_staged(endpoint, request_id, src, dst)
        except Exception as exc:  # KVTransferError and anything under it: recompute, lose nothing
            log.warning(
                "KV pull %s from %s failed (%s); recomputing the prompt", request_id, endpoint, exc
            )
            return False
        return True

    async def _pull_staged(
        self, endpoint: str, request_id: str, src: list[int], dst: list[int]
    ) -> None:
        """Pull into staging blocks, then have the engine split them over its ranks."""
        ids = self._staging.take(len(dst))
        if ids is None:
            raise RuntimeError(f"no room to stage {len(dst)} blocks")
        try:
            await self._client.pull(endpoint, request_id, src, ids)
            await self.loop.call(self.loop.engine.write_kv_blocks, dst, self._staging.read(ids))
        finally:
            self._staging.give_back(ids)

    def _on_release(self, request_id: str) -> None:
        # Called on the event loop by the transfer server; the engine call goes to its thread.
        staged = self._staged.pop(request_id, None)
        if staged is not None:
            self._staging.give_back(staged)
        task = asyncio.get_running_loop().create_task(self._release(request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, request_id: str) -> None:
        try:
            await self.loop.call(self.loop.engine.release, request_id)
        except Exception:  # already aborted or released: nothing left to free
            log.debug("release of %s: nothing held", request_id, exc_info=True)
