"""Moving a prompt's full KV blocks between an engine's pool and the KV-cache service.

Both helpers use only the engine's public API and must run on the thread that drives the
engine (between two ``step()`` calls):

- :func:`offload_prefix` stores the full blocks of a prefilled request (a held
  prefill-only request, from ``export_sequence``) under their content hashes.
- :func:`snapshot_stored_blocks` copies out blocks the engine just named (its "stored"
  KV events) so they can be written through to the service while the engine runs on;
  :func:`offload_snapshot` sends them.
- :func:`fetch_prefix` finds the longest cached prefix of a prompt, lands it in fresh
  blocks of the pool and names them in the engine's prefix cache, so the next
  ``add_request`` with that prompt computes only the rest.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from tokenyard.kv.hashing import prefix_block_hashes, salted_root
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.client import KVCacheClient, KVCacheError
from tokenyard.kv.transfer.common import copy_blocks


async def offload_prefix(engine: Any, client: KVCacheClient, request_id: str) -> int:
    """Store a held request's full prompt blocks; returns how many were stored."""
    exported = engine.export_sequence(request_id)
    hashes = prefix_block_hashes(exported.prompt_token_ids, engine.layout.block_size)
    return await client.put_blocks(
        engine.layout, hashes, engine.kv_cache, exported.block_ids[: len(hashes)]
    )


def snapshot_stored_blocks(engine: Any, hashes: list[int]) -> tuple[list[int], torch.Tensor]:
    """The hashes still cached by the engine and a copy of their blocks (a small pool).

    Call on the engine's thread right after the step that stored them: a cached block can
    be reused for other tokens by any later step, so the bytes are copied out now."""
    # NOTE: reads the block manager's hash -> block id map; the engine has no public
    # lookup for it yet.
    cached: dict[int, int] = engine.block_manager.cached
    found = [(h, cached[h]) for h in hashes if h in cached]
    snapshot = torch.empty(engine.layout.pool_shape(len(found)), dtype=engine.kv_cache.dtype)
    copy_blocks(engine.kv_cache, snapshot, [b for _, b in found], list(range(len(found))))
    return [h for h, _ in found], snapshot


async def offload_snapshot(
    client: KVCacheClient, layout: KVLayout, hashes: list[int], snapshot: torch.Tensor
) -> int:
    """Send a :func:`snapshot_stored_blocks` result to the service (from any thread's loop)."""
    if not hashes:
        return 0
    return await client.put_blocks(layout, hashes, snapshot, list(range(len(hashes))))


async def _direct(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


async def fetch_prefix(
    engine: Any,
    client: KVCacheClient,
    token_ids: list[int],
    call: Callable[..., Awaitable[Any]] = _direct,
    cache_salt: str = "",
) -> int:
    """Seed the engine's prefix cache from the service; returns the tokens now cached
    (0 on a miss or any cache failure: the engine then simply computes them).

    ``call(fn, *args)`` runs an engine call where the engine lives (a worker passes its
    engine thread's); the bytes land in blocks that belong to an uncommitted import, which
    no engine step touches, so they are written from here while the engine runs on."""
    from tokenyard.engine.sampling_params import SamplingParams

    bs = engine.layout.block_size
    # The engine always computes the block holding the prompt's last token itself.
    hashes = prefix_block_hashes(token_ids, bs, salted_root(cache_salt))
    hashes = hashes[: (len(token_ids) - 1) // bs]
    if not hashes:
        return 0
    try:
        n = await client.contains(engine.layout, hashes)
    except Exception:  # a cache outage costs a recompute, never the request
        return 0
    if n == 0:
        return 0
    # NOTE: the engine has no "import a prefix" call yet; an imported sequence committed
    # with kv_ok=True names its blocks in the prefix cache, and aborting it right away
    # leaves them there, unreferenced and findable, exactly like a finished request's.
    rid = f"kv-prefetch-{uuid.uuid4().hex[:12]}"
    prefix = token_ids[: n * bs]
    params = SamplingParams(max_tokens=1, cache_salt=cache_salt)
    dst = await call(engine.import_sequence, rid, prefix, [token_ids[n * bs]], params)
    try:
        landed = await client.get_prefix(engine.layout, hashes[:n], engine.kv_cache, dst)
    except (KVCacheError, OSError):
        landed = 0
    if landed < n:  # evicted meanwhile: drop it all rather than register a partial prefix
        await call(engine.abort, rid)
        return 0
    await call(_commit_and_drop, engine, rid)
    return n * bs


def _commit_and_drop(engine: Any, rid: str) -> None:
    # One engine-thread call: no step may run between the two and schedule the sequence.
    engine.commit_import(rid, kv_ok=True)
    engine.abort(rid)
