"""The worker's end of the KV hand-off, over tokenyard.kv.transfer.

Prefill side: :meth:`KVPort.offer` holds a prefilled request's blocks for a decode worker to
pull; the transfer layer ends the hold (pulled, aborted or timed out) and the blocks go back
to the engine. Decode side: :meth:`KVPort.pull` copies them into freshly imported blocks.
With no pool to share (a fake engine, or ``kv_transfer=False``) there is no endpoint and
decode workers recompute the prompt instead: same call sites, slower but correct.
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

    @property
    def enabled(self) -> bool:
        return self.settings.kv_transfer and self.loop.engine.kv_cache is not None

    async def start(self) -> None:
        pool, layout = self.loop.engine.kv_cache, self.loop.engine.layout
        if not self.settings.kv_transfer or pool is None or layout is None:
            return
        from tokenyard.kv.transfer import KVTransferClient, KVTransferServer

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

    def offer(self, request_id: str, block_ids: list[int]) -> str:
        """Hold the blocks for a pull; returns the endpoint, or "" (then release them yourself)."""
        if self._server is None:
            return ""
        self._server.offer(request_id, block_ids)
        return self.endpoint

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
            await self._client.pull(endpoint, request_id, src, dst)
        except Exception as exc:  # KVTransferError and anything under it: recompute, lose nothing
            log.warning(
                "KV pull %s from %s failed (%s); recomputing the prompt", request_id, endpoint, exc
            )
            return False
        return True

    def _on_release(self, request_id: str) -> None:
        # Called on the event loop by the transfer server; the engine call goes to its thread.
        task = asyncio.get_running_loop().create_task(self._release(request_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, request_id: str) -> None:
        try:
            await self.loop.call(self.loop.engine.release, request_id)
        except Exception:  # already aborted or released: nothing left to free
            log.debug("release of %s: nothing held", request_id, exc_info=True)


class KVCachePort:
    """The worker's use of the shared KV-cache service (``kvcache_endpoint``; "" = off).

    Before a prompt is computed, :meth:`fetch` seeds the engine's prefix cache with the
    longest prefix the service holds; after, :meth:`offload` writes the prompt's new full
    blocks through. The cache only ever saves work: any failure is logged and the request
    goes on as if it had missed.
    """

    def __init__(self, loop: EngineLoop, settings: WorkerSettings) -> None:
        self.loop = loop
        self.settings = settings
        self._client: Any = None
        self._puts: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._client is not None

    async def start(self) -> None:
        if not self.settings.kvcache_endpoint or self.loop.engine.kv_cache is None:
            return
        from tokenyard.kv.store.client import KVCacheClient

        self._client = KVCacheClient(
            self.settings.kvcache_endpoint, timeout_s=self.settings.kvcache_timeout_s
        )
        log.info("KV-cache service at %s", self.settings.kvcache_endpoint)

    async def stop(self) -> None:
        while self._puts:  # an offload still copying out starts its upload meanwhile
            await asyncio.gather(*self._puts, return_exceptions=True)
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def fetch(self, request_id: str, prompt: list[int], cache_salt: str = "") -> int:
        """Seed the engine with the cached prefix of ``prompt``; returns its tokens (0 = miss)."""
        if self._client is None:
            return 0
        from tokenyard.kv.store.engine_bridge import fetch_prefix

        try:
            n = await fetch_prefix(
                self.loop.engine, self._client, prompt, call=self.loop.call, cache_salt=cache_salt
            )
        except Exception as exc:  # no free blocks, the service gone: compute it all instead
            log.warning("KV-cache fetch for %s failed (%s); computing", request_id, exc)
            return 0
        if n:
            log.info("KV-cache hit for %s: %d prompt tokens fetched", request_id, n)
        return n

    def offload_soon(
        self, request_id: str, prompt: list[int], skip_tokens: int = 0, cache_salt: str = ""
    ) -> None:
        """:meth:`offload` in a task of its own, which :meth:`stop` waits for."""
        if self._client is None:
            return
        task = asyncio.get_running_loop().create_task(
            self.offload(request_id, prompt, skip_tokens, cache_salt)
        )
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def offload(
        self, request_id: str, prompt: list[int], skip_tokens: int = 0, cache_salt: str = ""
    ) -> None:
        """Write the prompt's full blocks past ``skip_tokens`` through to the service.

        Call while the blocks are still in the engine's prefix cache (right after the
        prompt was computed); only the copy-out runs on the engine thread, the upload runs
        in the background."""
        if self._client is None:
            return
        from tokenyard.kv.hashing import prefix_block_hashes, salted_root
        from tokenyard.kv.store.engine_bridge import snapshot_stored_blocks

        engine = self.loop.engine
        bs = engine.block_size
        hashes = prefix_block_hashes(prompt, bs, salted_root(cache_salt))[skip_tokens // bs :]
        if not hashes:
            return
        try:
            found, snapshot = await self.loop.call(snapshot_stored_blocks, engine, hashes)
        except Exception:
            log.warning("KV-cache snapshot of %s failed", request_id, exc_info=True)
            return
        task = asyncio.get_running_loop().create_task(self._put(request_id, found, snapshot))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _put(self, request_id: str, hashes: list[int], snapshot: Any) -> None:
        from tokenyard.kv.store.engine_bridge import offload_snapshot

        try:
            layout = self.loop.engine.layout
            assert layout is not None  # the client exists only for an engine with a pool
            n = await offload_snapshot(self._client, layout, hashes, snapshot)
            log.info("KV-cache offload of %s: %d blocks stored", request_id, n)
        except Exception as exc:
            log.warning("KV-cache offload of %s failed (%s)", request_id, exc)
