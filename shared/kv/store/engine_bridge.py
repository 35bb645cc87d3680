"""Moving a prompt's full KV blocks between an engine's pool and the KV-cache service.

The helpers use only :class:`tokenyard.kv.engine_port.KVEngine` and must run their engine
calls on the thread that drives the engine (between two ``step()`` calls):

- :func:`snapshot_stored_blocks` copies out blocks the engine just named (its "stored"
  KV events) so they can be written through to the service while the engine runs on;
  :func:`offload_snapshot` sends them. :func:`offload_prefix` does both for a held
  prefill-only request's prompt, under the same salted hashes.
- :func:`fetch_prefix` finds the longest cached prefix of a prompt past what the engine
  holds, fetches it into host memory (:func:`stage_prefix`, no engine call) and has the
  engine land it in one call (:func:`land_staged`), so the next ``add_request`` with that
  prompt computes only the rest. A worker queues the landing right before the request's
  ``add_request``: both run at the same step boundary.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenyard.kv.engine_port import KVEngine
from tokenyard.kv.hashing import prefix_block_hashes, salted_root
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.client import KVCacheClient, KVCacheError


def _layout(engine: KVEngine) -> KVLayout:
    if engine.layout is None:
        raise ValueError("this engine has no KV pool to move blocks in or out of")
    return engine.layout


def snapshot_stored_blocks(engine: KVEngine, hashes: list[int]) -> tuple[list[int], torch.Tensor]:
    """The hashes still cached by the engine and a copy of their blocks (a small pool, every
    KV head: a tensor-parallel engine gathers its ranks' shares).

    Call on the engine's thread right after the step that stored them: a cached block can
    be reused for other tokens by any later step, so the bytes are copied out now."""
    _layout(engine)
    found = engine.cached_block_ids(hashes)
    snapshot = engine.read_kv_blocks([b for _, b in found])
    return [h for h, _ in found], snapshot


async def offload_snapshot(
    client: KVCacheClient, layout: KVLayout, hashes: list[int], snapshot: torch.Tensor
) -> int:
    """Send a :func:`snapshot_stored_blocks` result to the service (from any thread's loop)."""
    if not hashes:
        return 0
    return await client.put_blocks(layout, hashes, snapshot, list(range(len(hashes))))


async def offload_prefix(
    engine: KVEngine, client: KVCacheClient, request_id: str, cache_salt: str = ""
) -> int:
    """Store a held request's full prompt blocks under their salted hashes, by the worker's
    own write-through path (snapshot, then send); returns how many were stored."""
    layout = _layout(engine)
    prompt = engine.export_sequence(request_id).prompt_token_ids
    hashes = prefix_block_hashes(prompt, layout.block_size, salted_root(cache_salt))
    found, snapshot = snapshot_stored_blocks(engine, hashes)
    return await offload_snapshot(client, layout, found, snapshot)


async def _direct(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass(frozen=True)
class StagedPrefix:
    """A prompt's cached prefix, fetched into host memory and not yet in the engine.

    ``token_ids`` is the prefix (whole blocks); the engine held its first ``first`` blocks
    when it was staged, and ``blocks`` holds the KV of the ones after (None: nothing to
    land, the engine held all of it or the service had no more)."""

    token_ids: list[int]
    first: int
    blocks: torch.Tensor | None
    block_size: int
    # The prompt's leading blocks the service held when asked (0: not asked): an offload
    # of the prompt need not send them again.
    stored: int = 0

    @property
    def num_fetched(self) -> int:
        return 0 if self.blocks is None else int(self.blocks.shape[0])

    @property
    def tokens(self) -> int:
        """The prefix's tokens the engine holds once it is landed."""
        return len(self.token_ids)


async def stage_prefix(
    engine: KVEngine, client: KVCacheClient, token_ids: list[int], cache_salt: str = ""
) -> StagedPrefix:
    """Fetch the longest prefix of ``token_ids`` the service holds, past what the engine
    holds itself, into host memory; no engine call (the peek at the prefix cache is safe
    from any thread). A cache outage or a bad block stages what the engine holds only."""
    layout = _layout(engine)
    bs = layout.block_size
    # The engine always computes the block holding the prompt's last token itself.
    hashes = prefix_block_hashes(token_ids, bs, salted_root(cache_salt))
    hashes = hashes[: (len(token_ids) - 1) // bs]
    local = engine.num_cached_prefix_blocks(hashes)

    stored = 0

    def held(n: int, blocks: torch.Tensor | None = None) -> StagedPrefix:
        return StagedPrefix(token_ids[: n * bs], local, blocks, bs, stored)

    if local == len(hashes):
        # Here already (a system prompt every request shares): the engine finds it itself.
        return held(local)
    try:
        n = stored = await client.contains(layout, hashes)
    except Exception:  # a cache outage costs a recompute, never the request
        return held(local)
    if n <= local:
        return held(local)
    staged = torch.empty(layout.pool_shape(n - local), dtype=layout.torch_dtype)
    try:
        landed = await client.get_prefix(layout, hashes[local:n], staged, range(n - local))
    except (KVCacheError, OSError):
        return held(local)
    if landed == 0:
        return held(local)
    return held(local + landed, staged[:landed])


def land_staged(engine: KVEngine, staged: StagedPrefix, cache_salt: str = "") -> int:
    """On the engine's thread: name a staged prefix's blocks in the prefix cache; returns
    the prefix's tokens the engine now holds. Queue it right before the request's
    ``add_request`` so both run at the same step boundary."""
    if staged.blocks is None:
        return (
            engine.num_cached_prefix_blocks(
                prefix_block_hashes(staged.token_ids, staged.block_size, salted_root(cache_salt))
            )
            * staged.block_size
        )
    return engine.land_prefix(staged.token_ids, cache_salt, staged.blocks, staged.first)


async def fetch_prefix(
    engine: KVEngine,
    client: KVCacheClient,
    token_ids: list[int],
    call: Callable[..., Awaitable[Any]] = _direct,
    cache_salt: str = "",
) -> int:
    """Seed the engine's prefix cache from the service; returns the tokens now cached
    (0 on a miss or any cache failure: the engine then simply computes them).

    ``call(fn, *args)`` runs an engine call where the engine lives (a worker passes its
    engine thread's). The bytes come into host memory first (:func:`stage_prefix`), then
    one engine call lands them (:func:`land_staged`): no blocks are reserved across steps,
    and only the blocks the engine does not hold already move."""
    staged = await stage_prefix(engine, client, token_ids, cache_salt)
    if staged.blocks is None:
        return staged.tokens
    return int(await call(land_staged, engine, staged, cache_salt))
