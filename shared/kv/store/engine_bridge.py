"""Moving a prompt's full KV blocks between an engine's pool and the KV-cache service.

The helpers use only :class:`tokenyard.kv.engine_port.KVEngine` and must run their engine
calls on the thread that drives the engine (between two ``step()`` calls):

- :func:`snapshot_stored_blocks` copies out blocks the engine just named (its "stored"
  KV events) so they can be written through to the service while the engine runs on;
  :func:`offload_snapshot` sends them. :func:`offload_prefix` does both for a held
  prefill-only request's prompt, under the same salted hashes.
- :func:`fetch_prefix` finds the longest cached prefix of a prompt, lands it in blocks the
  engine reserved, and has the engine name them in its prefix cache, so the next
  ``add_request`` with that prompt computes only the rest.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
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
    engine thread's); the bytes land in reserved blocks, which no engine step touches, so
    they are written from here while the engine runs on."""
    layout = _layout(engine)
    bs = layout.block_size
    # The engine always computes the block holding the prompt's last token itself.
    hashes = prefix_block_hashes(token_ids, bs, salted_root(cache_salt))
    hashes = hashes[: (len(token_ids) - 1) // bs]
    if not hashes:
        return 0
    try:
        n = await client.contains(layout, hashes)
    except Exception:  # a cache outage costs a recompute, never the request
        return 0
    if n == 0:
        return 0
    if engine.num_cached_prefix_blocks(hashes[:n]) == n:
        # Here already (a system prompt every request shares): the engine finds it itself.
        # Fetching it again costs two waits for the engine thread between steps, most of a
        # loaded request's first token (docs/benchmarks.md).
        return n * bs
    rid = f"kv-prefetch-{uuid.uuid4().hex[:12]}"
    dst = await call(engine.reserve_prefix, rid, token_ids[: n * bs], cache_salt)
    landed = 0
    try:
        landed = await _get_into(engine, client, layout, hashes[:n], dst, call)
    except (KVCacheError, OSError):
        pass
    finally:
        # Evicted meanwhile (or failed): drop it all rather than register a partial prefix.
        await call(engine.commit_prefix, rid, landed == n)
    return n * bs if landed == n else 0


async def _get_into(
    engine: KVEngine,
    client: KVCacheClient,
    layout: KVLayout,
    hashes: list[int],
    dst: list[int],
    call: Callable[..., Awaitable[Any]],
) -> int:
    """Fetch blocks into the engine's reserved ``dst``: straight into its pool, or (a
    tensor-parallel engine, whose pool holds one rank's heads) through a host copy that
    the engine splits over its ranks; returns how many leading blocks landed."""
    if engine.kv_cache is not None:
        return await client.get_prefix(layout, hashes, engine.kv_cache, dst)
    staged = torch.empty(layout.pool_shape(len(hashes)), dtype=layout.torch_dtype)
    landed = await client.get_prefix(layout, hashes, staged, list(range(len(hashes))))
    if landed == len(hashes):
        await call(engine.write_kv_blocks, dst, staged)
    return landed
