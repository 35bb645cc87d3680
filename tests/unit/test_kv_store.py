"""The KV-cache tiers: LRU budgets, demotion on eviction, promotion on hit, integrity."""

from __future__ import annotations

import pytest

from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.tiered import Put, TieredStore, block_key, layout_key
from tokenyard.kv.store.tiers import DISK_FORMAT, FORMAT_FILE, DiskTier, RamTier

BLOCK = 100  # bytes per test block (the store does not care about layouts)
FRAMED = BLOCK + 4  # + crc32


def block(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


def store_with(tmp_path, ram_blocks: int, disk_blocks: int) -> TieredStore:
    return TieredStore(
        [RamTier(ram_blocks * FRAMED), DiskTier(tmp_path / "disk", disk_blocks * FRAMED)]
    )


async def test_ram_evictions_demote_to_disk_and_hits_promote(tmp_path):
    store = store_with(tmp_path, ram_blocks=2, disk_blocks=10)
    for i in range(4):
        await store.put(f"k{i}", block(i))
    ram, disk = store.tiers
    assert sorted(ram.index.sizes) == ["k2", "k3"]
    assert sorted(disk.index.sizes) == ["k0", "k1"]
    assert await store.get("k0") == block(0)  # from disk, now promoted
    assert "k0" in ram.index.sizes and "k0" not in disk.index.sizes
    assert "k2" in disk.index.sizes  # the LRU of RAM went down to make room
    assert (store.hits, store.misses, disk.counters.hits) == (1, 0, 1)
    assert await store.get("nope") is None
    assert store.misses == 1


async def test_last_tier_drops_least_recently_used(tmp_path):
    store = store_with(tmp_path, ram_blocks=1, disk_blocks=2)
    for i in range(5):
        await store.put(f"k{i}", block(i))
    assert store.dropped == 2
    assert [await store.contains(f"k{i}") for i in range(5)] == [False, False, True, True, True]


async def test_disk_tier_survives_a_restart_and_detects_corruption(tmp_path):
    store = store_with(tmp_path, ram_blocks=0, disk_blocks=10)
    await store.put("a/1", block(1))
    await store.put("a/2", block(2))
    reopened = store_with(tmp_path, ram_blocks=10, disk_blocks=10)
    assert await reopened.contains("a/1")
    path = reopened.tiers[1]._path("a/2")
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert await reopened.get("a/2") is None
    assert reopened.corrupt == 1 and not await reopened.contains("a/2")
    assert await reopened.get("a/1") == block(1)


def test_layout_digest_separates_models_and_dtypes():
    a = KVLayout("m", "float32", 16, 30, 3, 64)
    assert layout_key(a) == layout_key(KVLayout("m", "float32", 16, 30, 3, 64))
    assert layout_key(a) != layout_key(KVLayout("m", "bfloat16", 16, 30, 3, 64))
    assert layout_key(a) != layout_key(KVLayout("other", "float32", 16, 30, 3, 64))
    assert block_key("abc", 255) == "abc/00000000000000ff"


def test_store_needs_a_tier():
    with pytest.raises(ValueError):
        TieredStore([])


async def test_a_block_is_written_once_and_other_bytes_never_replace_it(tmp_path):
    store = store_with(tmp_path, ram_blocks=1, disk_blocks=10)
    assert await store.put("a/1", block(1)) is Put.STORED
    assert await store.put("a/2", block(2)) is Put.STORED  # a/1 goes down to disk
    assert "a/1" in store.tiers[1].index.sizes
    assert await store.put("a/1", block(1)) is Put.SAME
    assert await store.put("a/1", block(66)) is Put.REFUSED  # held on disk: still checked
    assert await store.put("a/2", block(66)) is Put.REFUSED  # held in RAM
    assert (await store.get("a/1"), await store.get("a/2")) == (block(1), block(2))
    assert store.refused == 2
    assert store.hits == 2  # the writes' look-ups counted no hits


async def test_a_corrupt_held_block_gives_way_to_a_new_write(tmp_path):
    store = store_with(tmp_path, ram_blocks=0, disk_blocks=10)
    await store.put("a/1", block(1))
    path = store.tiers[1]._path("a/1")
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert await store.put("a/1", block(7)) is Put.STORED
    assert store.corrupt == 1 and await store.get("a/1") == block(7)


async def test_a_block_under_another_key_is_never_served(tmp_path):
    # A file copied or renamed under another block's name fails its check: a miss, not
    # another block's bytes.
    store = store_with(tmp_path, ram_blocks=0, disk_blocks=10)
    await store.put("a/1", block(1))
    await store.put("a/2", block(2))
    disk = store.tiers[1]
    disk._path("a/2").write_bytes(disk._path("a/1").read_bytes())
    reopened = store_with(tmp_path, ram_blocks=10, disk_blocks=10)
    assert await reopened.get("a/2") is None
    assert reopened.corrupt == 1
    assert await reopened.get("a/1") == block(1)


async def test_disk_tier_of_another_format_starts_empty(tmp_path):
    store = store_with(tmp_path, ram_blocks=0, disk_blocks=10)
    await store.put("a/1", block(1))
    disk_dir = tmp_path / "disk"
    (disk_dir / FORMAT_FILE).write_text("ty-kv-disk-v1\n")
    (disk_dir / "a~9.tmp").write_bytes(b"half a write")
    reopened = store_with(tmp_path, ram_blocks=10, disk_blocks=10)
    assert not await reopened.contains("a/1")
    assert list(disk_dir.glob("*.blk")) == [] and list(disk_dir.glob("*.tmp")) == []
    assert (disk_dir / FORMAT_FILE).read_text().strip() == DISK_FORMAT


async def test_disk_tier_restarted_smaller_drops_its_oldest_blocks(tmp_path):
    store = store_with(tmp_path, ram_blocks=0, disk_blocks=10)
    for i in range(4):
        await store.put(f"a/{i}", block(i))
    reopened = store_with(tmp_path, ram_blocks=0, disk_blocks=2)
    assert sorted(reopened.tiers[1].index.sizes) == ["a/2", "a/3"]
    assert len(list((tmp_path / "disk").glob("*.blk"))) == 2
