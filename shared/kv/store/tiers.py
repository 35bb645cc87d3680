"""The storage tiers of the KV-cache service: host RAM, Redis, a local disk directory.

Each tier is an LRU under its own byte budget and says what it evicted, so the tiered store
can demote it one tier down. Values are opaque bytes; keys are ``<layout>/<block hash>``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import cast

log = logging.getLogger(__name__)

# (key, value) pushed out of a tier; value None = dropped unread (nothing below it).
Evicted = list[tuple[str, bytes | None]]


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0  # look-ups that reached this tier and did not find the block
    evictions: int = 0


class _LruIndex:
    """key -> size in LRU order, with the byte total: the budget logic every tier shares."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.nbytes = 0

    def add(self, key: str, size: int) -> None:
        self.discard(key)
        self.sizes[key] = size
        self.nbytes += size

    def touch(self, key: str) -> None:
        self.sizes.move_to_end(key)

    def discard(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.nbytes -= size

    def over_budget(self) -> list[str]:
        """Least recently used keys to drop until the tier fits (dropped from the index)."""
        victims = []
        while self.nbytes > self.capacity_bytes and self.sizes:
            key, size = self.sizes.popitem(last=False)
            self.nbytes -= size
            victims.append(key)
        return victims


class RamTier:
    name = "ram"

    def __init__(self, capacity_bytes: int):
        self.index = _LruIndex(capacity_bytes)
        self.counters = TierCounters()
        self._data: dict[str, bytes] = {}

    async def get(self, key: str) -> bytes | None:
        value = self._data.get(key)
        if value is not None:
            self.index.touch(key)
            self.counters.hits += 1
        return value

    async def contains(self, key: str) -> bool:
        return key in self._data

    async def peek(self, key: str) -> bytes | None:
        """The value, without counting a hit or touching the LRU order."""
        return self._data.get(key)

    async def put(self, key: str, value: bytes) -> Evicted:
        self._data[key] = value
        self.index.add(key, len(value))
        evicted: Evicted = [(k, self._data.pop(k)) for k in self.index.over_budget()]
        self.counters.evictions += len(evicted)
        return evicted

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)
        self.index.discard(key)


class RedisTier:
    """Blocks in Redis under a key prefix with a TTL. The LRU index is this process's view
    (Redis may also drop keys by TTL or its own maxmemory; a vanished key is a miss)."""

    name = "redis"

    def __init__(self, url: str, capacity_bytes: int, *, prefix: str, ttl_s: int):
        import redis.asyncio as redis

        # decode_responses stays False: values are raw block bytes.
        self._redis: redis.Redis = redis.from_url(url, decode_responses=False)
        self._prefix, self._ttl_s = prefix, ttl_s
        self.index = _LruIndex(capacity_bytes)
        self.counters = TierCounters()

    async def get(self, key: str) -> bytes | None:
        value = cast(bytes | None, await self._redis.get(self._prefix + key))
        if value is None:
            self.index.discard(key)
            return None
        self.index.add(key, len(value))  # also adopts keys written by an earlier run
        self.counters.hits += 1
        return value

    async def contains(self, key: str) -> bool:
        return bool(await self._redis.exists(self._prefix + key))

    async def peek(self, key: str) -> bytes | None:
        """The value, without counting a hit or touching the LRU order."""
        return cast(bytes | None, await self._redis.get(self._prefix + key))

    async def put(self, key: str, value: bytes) -> Evicted:
        await self._redis.set(self._prefix + key, value, ex=self._ttl_s)
        self.index.add(key, len(value))
        evicted: Evicted = []
        for victim in self.index.over_budget():
            old = cast(bytes | None, await self._redis.getdel(self._prefix + victim))
            if old is not None:
                evicted.append((victim, old))
        self.counters.evictions += len(evicted)
        return evicted

    async def delete(self, key: str) -> None:
        await self._redis.delete(self._prefix + key)
        self.index.discard(key)

    async def close(self) -> None:
        await self._redis.aclose()


# The disk tier's format: one file per block, a crc32 of the key and the bytes first
# (tiered.frame). Bump it when that changes.
DISK_FORMAT = "ty-kv-disk-v2"
FORMAT_FILE = "FORMAT"


class DiskTier:
    """One file per block in a directory, LRU by mtime; survives a restart (the index is
    rebuilt from the files, oldest first)."""

    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = _LruIndex(capacity_bytes)
        self.counters = TierCounters()
        self._check_format()
        for tmp in self.dir.glob("*.tmp"):  # a write cut short: never renamed into place
            tmp.unlink(missing_ok=True)
        files = sorted(self.dir.glob("*.blk"), key=lambda p: p.stat().st_mtime)
        for path in files:
            self.index.add(path.stem.replace("~", "/"), path.stat().st_size)
        for victim in self.index.over_budget():  # restarted with a smaller budget
            self._path(victim).unlink(missing_ok=True)

    def _check_format(self) -> None:
        """Blocks written in another format (another framing, an older release) are removed:
        read as ours, they would only fail their checks one by one."""
        marker = self.dir / FORMAT_FILE
        found = marker.read_text().strip() if marker.exists() else ""
        if found == DISK_FORMAT:
            return
        stale = list(self.dir.glob("*.blk"))
        if stale:
            log.warning(
                "KV disk tier %s: %d blocks in format %r, not %r; removed",
                self.dir,
                len(stale),
                found or "unknown",
                DISK_FORMAT,
            )
        for path in stale:
            path.unlink(missing_ok=True)
        _write_atomically(marker, DISK_FORMAT.encode() + b"\n")

    def _path(self, key: str) -> Path:
        return self.dir / (key.replace("/", "~") + ".blk")

    async def get(self, key: str) -> bytes | None:
        if key not in self.index.sizes:
            return None
        try:
            value = await asyncio.to_thread(self._path(key).read_bytes)
        except FileNotFoundError:  # removed behind our back
            self.index.discard(key)
            return None
        os.utime(self._path(key))
        self.index.touch(key)
        self.counters.hits += 1
        return value

    async def contains(self, key: str) -> bool:
        return key in self.index.sizes

    async def peek(self, key: str) -> bytes | None:
        """The value, without counting a hit or touching the LRU order."""
        if key not in self.index.sizes:
            return None
        try:
            return await asyncio.to_thread(self._path(key).read_bytes)
        except FileNotFoundError:
            return None

    async def put(self, key: str, value: bytes) -> Evicted:
        await asyncio.to_thread(_write_atomically, self._path(key), value)
        self.index.add(key, len(value))
        evicted: Evicted = []
        for victim in self.index.over_budget():
            self._path(victim).unlink(missing_ok=True)
            evicted.append((victim, None))
        self.counters.evictions += len(evicted)
        return evicted

    async def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        self.index.discard(key)


def _write_atomically(path: Path, value: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(value)
    os.replace(tmp, path)


Tier = RamTier | RedisTier | DiskTier
