"""KV blocks by content hash across tiers: RAM -> Redis -> disk.

Tiers are exclusive: a block lives in one of them. A new block enters RAM; what a tier
evicts is demoted one tier down; what the last tier evicts is gone. A hit in a lower tier
promotes the block back to RAM. Keys carry a digest of the layout, so a block written by
one model or dtype is never served to another; values carry a crc32 of their key and bytes that
is checked whenever bytes come back from Redis or disk, so a corrupt or misplaced block is
dropped (a miss), never served.

A block is written once (:meth:`TieredStore.put`): a later write of other bytes under
the same key is refused, so no writer can replace a block that others already read.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import struct
from dataclasses import asdict

from tokenyard.kv.checksum import crc32
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.tiers import Evicted, Tier

log = logging.getLogger(__name__)

_CRC = struct.Struct("<I")


def layout_key(layout: KVLayout) -> str:
    """Short stable name of a layout (model, dtype, shape, hash spec) for block keys."""
    text = repr(sorted(asdict(layout).items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def block_key(layout_digest: str, block_hash: int) -> str:
    return f"{layout_digest}/{block_hash:016x}"


def _crc(key: str, data: bytes) -> int:
    return crc32(data, crc32(key.encode()))


def frame(key: str, data: bytes) -> bytes:
    """The block's bytes behind a crc32 of its key and bytes.

    NOTE: the key is in the checksum so that bytes found under another key (a file copied
    or renamed on disk, a Redis value written by another store) fail the check and are
    never served as this block."""
    return _CRC.pack(_crc(key, data)) + data


def unframe(key: str, value: bytes) -> bytes | None:
    """The block's bytes, or None if they were corrupted at rest or belong to another key."""
    if len(value) < _CRC.size:
        return None
    (crc,) = _CRC.unpack_from(value)
    data = value[_CRC.size :]
    return data if _crc(key, data) == crc else None


class Put(enum.Enum):
    """What a write did."""

    STORED = "stored"  # the key was free: the block is held now
    SAME = "same"  # the same bytes were held already: nothing changed
    REFUSED = "refused"  # other bytes are held under the key: they stay


class TieredStore:
    def __init__(self, tiers: list[Tier]):
        if not tiers:
            raise ValueError("a KV store needs at least one tier")
        self.tiers = tiers
        self.hits = 0
        self.misses = 0
        self.dropped = 0  # evicted from the last tier
        self.corrupt = 0
        self.refused = 0  # writes of other bytes under a key already held
        # Demotion cascades await between tiers; one op at a time keeps them consistent.
        self._lock = asyncio.Lock()

    async def put(self, key: str, data: bytes) -> Put:
        """Store a block under a key no tier holds; a key already held keeps its bytes.

        NOTE: first writer wins, never last: a block key is a hash of the tokens (and the
        cache salt) the block was computed from, never of its bytes, so an overwrite would
        let any writer swap the KV behind a prefix that other requests already share."""
        async with self._lock:
            held = await self._held(key)
            if held is None:
                await self._put_at(0, key, frame(key, data))
                return Put.STORED
            if held == data:
                return Put.SAME
            self.refused += 1
            return Put.REFUSED

    async def _held(self, key: str) -> bytes | None:
        """The bytes some tier holds under ``key`` (no hit counted); a copy that fails its
        crc32 is dropped, as a read would."""
        for tier in self.tiers:
            value = await tier.peek(key)
            if value is None:
                continue
            return await self._checked(tier, key, value)
        return None

    async def _checked(self, tier: Tier, key: str, value: bytes) -> bytes | None:
        """A tier's framed value unframed, or None: a copy that fails its crc32 is deleted."""
        data = unframe(key, value)
        if data is None:
            log.warning("KV block %s corrupt in %s; dropped", key, tier.name)
            self.corrupt += 1
            await tier.delete(key)
        return data

    async def get(self, key: str) -> bytes | None:
        """The block's bytes (promoted to RAM) or None; counts a hit or a miss."""
        async with self._lock:
            for level, tier in enumerate(self.tiers):
                value = await tier.get(key)
                if value is None:
                    tier.counters.misses += 1
                    continue
                data = await self._checked(tier, key, value)
                if data is None:
                    break
                if level > 0:
                    await tier.delete(key)
                    await self._put_at(0, key, value)
                self.hits += 1
                return data
            self.misses += 1
            return None

    async def evict(self, key: str) -> bool:
        """Drop a block from every tier; True when some tier held it."""
        async with self._lock:
            held = False
            for tier in self.tiers:
                if await tier.contains(key):
                    held = True
                    await tier.delete(key)
            return held

    async def clear(self) -> tuple[int, int]:
        """Drop every block this service indexes; returns (blocks, bytes) dropped."""
        async with self._lock:
            blocks = nbytes = 0
            for tier in self.tiers:
                blocks += len(tier.index.sizes)
                nbytes += tier.index.nbytes
                for key in list(tier.index.sizes):
                    await tier.delete(key)
            return blocks, nbytes

    async def contains(self, key: str) -> bool:
        for tier in self.tiers:
            if await tier.contains(key):
                return True
        return False

    async def _put_at(self, level: int, key: str, value: bytes) -> None:
        evicted: Evicted = await self.tiers[level].put(key, value)
        for victim, old in evicted:
            if level + 1 < len(self.tiers) and old is not None:
                await self._put_at(level + 1, victim, old)
            else:
                self.dropped += 1

    async def close(self) -> None:
        for tier in self.tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                await close()
