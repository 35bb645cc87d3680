"""What the KV package needs from an engine, stated here so that kv never imports the engine.

The engine (tokenyard.engine.llm_engine) depends on kv for its pool layout; the helpers that
move blocks between an engine's pool and the KV-cache service (kv/store/engine_bridge.py)
depend only on this Protocol, so the two packages do not import each other. Every call but
`num_cached_prefix_blocks` must run on the thread that drives the engine, between two steps.

The two prefix-cache lookups are implemented here, over the cache's index (block hash ->
block id); the reservations are the engine's (tokenyard.engine.handoff.SequenceHandoff), since
they are sequences of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from tokenyard.kv.layout import KVLayout


class PromptBlocks(Protocol):
    """A held prefill's prompt and the physical blocks holding its KV."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def block_ids(self) -> list[int]: ...


class KVEngine(Protocol):
    @property
    def layout(self) -> KVLayout | None:
        """The layout blocks cross the engine's boundary in (every KV head: tp_size 1);
        None for an engine with no KV pool (a test double)."""

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """The pool itself: [num_blocks, ...] as ``layout.pool_shape`` says; None with no pool
        or none in that layout (a tensor-parallel engine's: read_kv_blocks, write_kv_blocks)."""

    def export_sequence(self, request_id: str) -> PromptBlocks:
        """A held (prefilled, prefill-only) request's prompt and blocks."""
        ...

    def cached_block_ids(self, hashes: list[int]) -> list[tuple[int, int]]:
        """(hash, block id) for each of ``hashes`` whose block is in the prefix cache now."""
        ...

    def num_cached_prefix_blocks(self, hashes: list[int]) -> int:
        """How many of ``hashes``, from the first, the prefix cache holds now. Unlike every
        other call here, safe from any thread: a peek whose answer may be stale by the time
        it is used, which costs a recompute or a needless fetch, never a wrong result."""
        ...

    def reserve_prefix(
        self, request_id: str, token_ids: list[int], cache_salt: str = ""
    ) -> list[int]:
        """Fresh blocks for a prefix of whole blocks whose KV is written from outside,
        named under ``cache_salt``'s prefix root once committed.

        No step touches them until :meth:`commit_prefix`; raises NoFreeBlocks when full."""
        ...

    def commit_prefix(self, request_id: str, kv_ok: bool) -> None:
        """kv_ok: name the blocks in the prefix cache (free but findable); else drop them."""
        ...

    def land_prefix(
        self, token_ids: list[int], cache_salt: str, blocks: torch.Tensor, first: int
    ) -> int:
        """Name a prefix of whole blocks (under ``cache_salt``'s root) in the prefix cache in
        one call, with no reservation between steps: blocks it holds already are kept,
        ``blocks`` (in ``layout``, the prefix's blocks ``first`` on) fill fresh ones for the
        rest, as many as the pool has free. Returns the prefix's leading tokens now cached
        (fewer than asked when the pool is short, or its cached head was evicted before
        ``first``: a recompute, never a wrong block)."""
        ...

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of the blocks in ``layout`` (every KV head, whatever the engine's
        tensor-parallel size: its ranks' shares gathered); ValueError with no pool."""
        ...

    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write blocks in ``layout`` into the pool (each tensor-parallel rank its heads):
        blocks the engine reserved or imported, before they are committed."""
        ...


def cached_block_ids(cached: Mapping[int, int], hashes: list[int]) -> list[tuple[int, int]]:
    """(hash, block id) for each of ``hashes`` in the prefix cache's index ``cached``."""
    return [(h, cached[h]) for h in hashes if h in cached]


def num_cached_prefix_blocks(cached: Mapping[int, int], hashes: list[int]) -> int:
    """How many of ``hashes``, from the first, ``cached`` holds.

    NOTE: called from any thread (KVEngine.num_cached_prefix_blocks): dict lookups only,
    atomic under the GIL, never an iteration of ``cached``, which a step may be changing."""
    return next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
