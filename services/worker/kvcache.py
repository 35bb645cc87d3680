"""The worker's use of the shared KV-cache service (``kvcache_endpoint``; "" = off).

Before a prompt is computed, :meth:`KVCachePort.stage` fetches the longest prefix the service
holds past what the engine holds into host memory, while the request waits for admission;
:meth:`KVCachePort.land_soon` has the engine name those blocks in its prefix cache at the
same step boundary as the request's add (one engine call, no blocks reserved meanwhile).
Two kinds of blocks go the other way, each as soon as it is computed and still in the pool:

- a prompt's new full blocks, with its first token (``source="prompt"``);
- a finished request's reply blocks (``source="reply"``): a chat's next turn sends them
  back as its prompt. Whichever worker decoded the reply sends them: the aggregated worker
  that prefilled it, or the decode worker a prefill worker handed it to (decode.py).

Together these are every block that can later be evicted from the pool (a block becomes
evictable only when its last request ends), sent while the engine still holds their bytes:
at eviction itself the engine is inside a step, about to write over them.

Only the copy-out runs on the engine thread, between two steps (a memcpy of the blocks);
the upload runs in a task of its own. :class:`BandwidthBudget` caps the bytes per second
sent (and so the copy-outs): blocks over it are dropped and counted. The cache only ever
saves work: any failure is logged and the request goes on as if it had missed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenyard.kv.store.offload import BandwidthBudget, RecentHashes
from tokenyard.services.worker.engine_loop import EngineLoop
from tokenyard.services.worker.metrics import KV_OFFLOAD_FAILURES, WorkerMetrics
from tokenyard.services.worker.settings import WorkerSettings
from tokenyard.services.worker.stream import HANDED_BACK

if TYPE_CHECKING:
    from tokenyard.kv.store.engine_bridge import StagedPrefix

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixHit:
    cached_tokens: int  # the prompt's leading tokens the engine now holds (0 = a miss)
    fetched_tokens: int  # of those, the ones fetched from the service (the rest were here)


RECENT_HASHES = 65536  # blocks known to be in the service: about 48 GB of SmolLM2-135M's
RECENT_TTL_S = 300.0
FETCH_COST_WEIGHT = 0.2  # weight of the latest fetch in the moving average of its cost
# A request that ended so keeps no reply worth a next turn (handed back: it goes on elsewhere).
NOT_KEPT = ("abort", "error", HANDED_BACK)


class KVCachePort:
    def __init__(self, loop: EngineLoop, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self.loop = loop
        self.settings = settings
        self.metrics = metrics
        self.budget = BandwidthBudget(settings.kv_offload_bytes_per_s)
        self.sent = RecentHashes(RECENT_HASHES, RECENT_TTL_S)
        # Measured: milliseconds per block of a fetch, a moving average (0 = none yet). The
        # heartbeat carries it so the router can price a shared hit against recomputing it.
        self.fetch_ms_per_block = 0.0
        self._client: Any = None
        self._puts: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        return self._client is not None

    async def start(self) -> None:
        if not self.settings.kvcache_endpoint or self.loop.engine.layout is None:
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

    # --- fetch ---------------------------------------------------------------------------

    async def stage(
        self, request_id: str, prompt: list[int], cache_salt: str = ""
    ) -> StagedPrefix | None:
        """Fetch the cached prefix of ``prompt`` past what the engine holds into host
        memory, while the request waits for admission (no engine call: nothing is reserved
        in the pool). None with no service (or any failure: the engine computes it all)."""
        if self._client is None:
            return None
        from tokenyard.kv.store.engine_bridge import stage_prefix

        started = time.perf_counter()
        try:
            staged = await stage_prefix(self.loop.engine, self._client, prompt, cache_salt)
        except Exception as exc:  # a bad layout, a torch error: compute it all instead
            log.warning("KV-cache fetch for %s failed (%s); computing", request_id, exc)
            return None
        if staged.num_fetched:
            self._on_fetched(staged.num_fetched, time.perf_counter() - started)
        return staged

    def land_soon(
        self, request_id: str, staged: StagedPrefix | None, cache_salt: str = ""
    ) -> asyncio.Future[PrefixHit]:
        """Queue the landing of ``staged`` on the engine thread now: call it right before
        the request's add, with no await between, and both run at one step boundary."""
        done: asyncio.Future[PrefixHit] = asyncio.get_running_loop().create_future()
        if staged is None or staged.blocks is None:
            held = 0 if staged is None else staged.tokens
            done.set_result(PrefixHit(held, 0))
            return done
        from tokenyard.kv.store.engine_bridge import land_staged

        landing = self.loop.queue(land_staged, self.loop.engine, staged, cache_salt)

        def landed(future: asyncio.Future[int]) -> None:
            if future.cancelled() or future.exception() is not None:
                if not future.cancelled():
                    log.warning(
                        "KV-cache landing for %s failed: %s", request_id, future.exception()
                    )
                done.set_result(PrefixHit(0, 0))
                return
            n = future.result()
            fetched = max(0, n - staged.first * staged.block_size)
            if fetched:
                from tokenyard.kv.hashing import prefix_block_hashes, salted_root

                bs = staged.block_size
                hashes = prefix_block_hashes(staged.token_ids[:n], bs, salted_root(cache_salt))
                self.sent.add(hashes)
                log.info("KV-cache hit for %s: %d prompt tokens fetched", request_id, fetched)
            done.set_result(PrefixHit(n, fetched))

        landing.add_done_callback(landed)
        return done

    async def fetch(self, request_id: str, prompt: list[int], cache_salt: str = "") -> PrefixHit:
        """:meth:`stage` then :meth:`land_soon`, for a caller with no add to queue behind."""
        return await self.land_soon(
            request_id, await self.stage(request_id, prompt, cache_salt), cache_salt
        )

    def _on_fetched(self, num_blocks: int, seconds: float) -> None:
        layout = self.loop.engine.layout
        assert layout is not None  # the client exists only for an engine with a pool
        self.metrics.on_fetch(num_blocks * layout.block_nbytes)
        ms = seconds * 1000 / num_blocks
        avg = self.fetch_ms_per_block
        self.fetch_ms_per_block = ms if avg == 0 else avg + FETCH_COST_WEIGHT * (ms - avg)

    # --- offload -------------------------------------------------------------------------

    def offload_soon(
        self,
        request_id: str,
        tokens: list[int],
        skip_tokens: int = 0,
        cache_salt: str = "",
        source: str = "prompt",
    ) -> None:
        """:meth:`offload` in a task of its own, which :meth:`stop` waits for."""
        if self._client is None:
            return
        self._track(self.offload(request_id, tokens, skip_tokens, cache_salt, source))

    def offload_reply(
        self, request_id: str, prompt: list[int], output: list[int], cache_salt: str, reason: str
    ) -> None:
        """A finished request's reply blocks, for a chat's next turn (the prompt's full
        blocks went with the first token, from the worker that prefilled it)."""
        if not self.settings.kv_offload_replies or reason in NOT_KEPT or not output:
            return
        bs = self.loop.engine.block_size
        # The last token's KV was never computed: only blocks full before it are cached.
        tokens = prompt + output[:-1]
        skip = len(prompt) // bs * bs
        self.offload_soon(request_id, tokens, skip, cache_salt, source="reply")

    def _track(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def offload(
        self,
        request_id: str,
        tokens: list[int],
        skip_tokens: int = 0,
        cache_salt: str = "",
        source: str = "prompt",
    ) -> None:
        """Write the full blocks of ``tokens`` past ``skip_tokens`` through to the service,
        as many leading ones as the bandwidth budget allows.

        Call while the blocks are still in the engine's prefix cache (right after they were
        computed, or as their request ends); only the copy-out runs on the engine thread,
        the upload runs in the background."""
        if self._client is None:
            return
        from tokenyard.kv.hashing import prefix_block_hashes, salted_root
        from tokenyard.kv.store.engine_bridge import snapshot_stored_blocks

        engine = self.loop.engine
        layout = engine.layout
        assert layout is not None
        bs = engine.block_size
        hashes = prefix_block_hashes(tokens, bs, salted_root(cache_salt))[skip_tokens // bs :]
        hashes = self.sent.unsent(hashes)
        if not hashes:
            return
        block_bytes = layout.block_nbytes
        n = self.budget.take_blocks(len(hashes), block_bytes)
        dropped = len(hashes) - n
        self.metrics.on_offload(source, 0, dropped * block_bytes)
        if dropped:
            log.debug("KV offload of %s: %d blocks over the budget, dropped", request_id, dropped)
        if n == 0:
            return
        try:
            found, snapshot = await self.loop.call(snapshot_stored_blocks, engine, hashes[:n])
        except Exception:
            self.budget.give_back(n * block_bytes)
            log.warning("KV-cache snapshot of %s failed", request_id, exc_info=True)
            return
        self.budget.give_back((n - len(found)) * block_bytes)  # evicted already: not sent
        self._track(self._put(request_id, source, found, snapshot))

    async def _put(self, request_id: str, source: str, hashes: list[int], snapshot: Any) -> None:
        from tokenyard.kv.store.engine_bridge import offload_snapshot

        try:
            layout = self.loop.engine.layout
            assert layout is not None
            n = await offload_snapshot(self._client, layout, hashes, snapshot)
        except Exception as exc:
            self.metrics.child(KV_OFFLOAD_FAILURES).inc()
            log.warning("KV-cache offload of %s failed (%s)", request_id, exc)
            return
        self.sent.add(hashes[:n])
        self.metrics.on_offload(source, n * layout.block_nbytes, 0)
        log.info("KV-cache offload of %s: %d blocks stored (%s)", request_id, n, source)
