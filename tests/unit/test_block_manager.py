"""The block pool's bookkeeping: allocation, prefix sharing, LRU eviction, no leaks."""

from __future__ import annotations

import pytest

from tokenyard.engine.block_manager import BlockManager, NoFreeBlocks
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.engine.sequence import Sequence
from tokenyard.kv.hashing import prefix_block_hashes

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), arrival=0)


def computed(bm: BlockManager, s: Sequence) -> None:
    """Pretend the model computed every token of `s`."""
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    s = seq(list(range(10)))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert s.num_computed_tokens == 0
    bm.free_sequence(s)
    bm.check_no_leaks()


def test_second_request_shares_computed_prefix_blocks():
    bm = BlockManager(16, BS)
    a = seq(list(range(13)), "a")
    bm.allocate(a)
    computed(bm, a)
    assert a.block_hashes == prefix_block_hashes(list(range(13)), BS)
    b = seq(list(range(12)) + [99, 98], "b")
    bm.allocate(b)
    assert b.block_table[:3] == a.block_table[:3]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.stats.hits == 12 and bm.stats.queries == 13 + 14
    bm.free_sequence(a)
    bm.free_sequence(b)
    bm.check_no_leaks()


def test_fully_cached_prompt_still_computes_its_last_block():
    bm = BlockManager(16, BS)
    a = seq(list(range(8)), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(list(range(8)), "b")
    bm.allocate(b)
    # the block holding the last token is fresh, so a shared block is never written
    assert b.num_computed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.free_sequence(a)
    bm.free_sequence(b)
    bm.check_no_leaks()


def test_uncomputed_blocks_are_not_shared():
    bm = BlockManager(16, BS)
    a = seq(list(range(12)), "a")
    bm.allocate(a)  # allocated but not computed yet
    b = seq(list(range(12)), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)


def test_freed_cached_blocks_survive_until_evicted_lru():
    bm = BlockManager(4, BS)
    a = seq(list(range(8)) + [1], "a")
    bm.allocate(a)
    computed(bm, a)
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    # a new unrelated sequence needing 3 blocks evicts the tail first, keeping block 0's content
    c = seq([50 + i for i in range(12)], "c")
    bm.allocate(c)
    assert len(bm.cached) == 1
    events = bm.drain_events()
    assert [k for k, _ in events] == ["stored", "stored", "removed"]
    bm.free_sequence(c)
    d = seq(list(range(4)) + [7, 7], "d")
    bm.allocate(d)
    assert d.num_cached_tokens == 4


def test_append_slots_grows_by_blocks_and_raises_when_full():
    bm = BlockManager(2, BS)
    s = seq([1, 2, 3, 4])
    bm.allocate(s)
    s.num_computed_tokens = 4
    assert bm.can_append(s, 1)
    bm.append_slots(s, 1)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 8
    assert not bm.can_append(s, 1)
    with pytest.raises(NoFreeBlocks):
        bm.append_slots(s, 1)


def test_double_free_is_caught():
    bm = BlockManager(4, BS)
    s = seq([1, 2])
    bm.allocate(s)
    table = list(s.block_table)
    bm.free_sequence(s)
    s.block_table = table
    with pytest.raises(AssertionError):
        bm.free_sequence(s)


def test_a_cache_salt_keeps_identical_prompts_apart():
    from tokenyard.kv.hashing import salted_root

    bm = BlockManager(32, BS)
    tokens = list(range(13))
    a = Sequence("a", tokens, SamplingParams(cache_salt="tenant:acme"), arrival=0)
    bm.allocate(a)
    computed(bm, a)
    assert a.block_hashes == prefix_block_hashes(tokens, BS, salted_root("tenant:acme"))
    assert a.block_hashes != prefix_block_hashes(tokens, BS)
    other = Sequence("b", tokens, SamplingParams(cache_salt="tenant:evil"), arrival=0)
    bm.allocate(other)
    assert other.num_cached_tokens == 0  # another tenant cannot probe acme's prefix
    plain = seq(tokens, "c")
    bm.allocate(plain)
    assert plain.num_cached_tokens == 0
    same = Sequence("d", tokens, SamplingParams(cache_salt="tenant:acme"), arrival=0)
    bm.allocate(same)
    assert same.num_cached_tokens == 12


def test_freed_blocks_holding_nothing_are_reused_before_untouched_ones():
    """A freed block without cached content goes to the front of the free list: its pages
    are already resident, while an untouched block's pages are not yet (lazy KV pool)."""
    bm = BlockManager(8, BS)
    a = seq(list(range(6)), "a")  # one full block, one partial
    bm.allocate(a)
    computed(bm, a)
    full, partial = a.block_table
    bm.free_sequence(a)
    b = seq(list(range(100, 103)), "b")
    bm.allocate(b)
    assert b.block_table == [partial]  # not block 2, never touched; not the cached one
    c = seq(list(range(6)), "c")
    bm.allocate(c)
    assert c.block_table[0] == full  # the cached prefix block survived


@pytest.mark.parametrize("grow", [True, False])
def test_the_prefix_cache_grows_the_pool_only_when_allowed(grow):
    bm = BlockManager(8, BS, grow_for_cache=grow)
    a = seq(list(range(8)), "a")  # two full blocks, cached once computed
    bm.allocate(a)
    computed(bm, a)
    first, second = a.block_table
    bm.free_sequence(a)
    b = seq(list(range(100, 104)), "b")
    bm.allocate(b)
    if grow:  # an untouched block; both cached blocks survive
        assert b.block_table == [2]
        c = seq(list(range(9)), "c")
        bm.allocate(c)
        assert c.block_table[:2] == [first, second]
    else:  # the least recently freed cached block (the tail: freed first) is reused
        assert b.block_table == [second]
        assert bm.num_free_blocks == 7


# --- land_prefix: a KV-cache service's prefix named in one call -------------------------


def landing(tokens: list[int]) -> tuple[list[int], list[tuple[int, ...]]]:
    hashes = prefix_block_hashes(tokens, BS)
    return hashes, [tuple(tokens[i * BS : (i + 1) * BS]) for i in range(len(hashes))]


def test_land_prefix_writes_only_the_blocks_not_held_and_names_them():
    bm = BlockManager(8, BS)
    a = seq(list(range(9)), "a")  # two full blocks computed here
    bm.allocate(a)
    computed(bm, a)
    held = list(a.block_table[:2])
    bm.free_sequence(a)
    bm.drain_events()
    prefix = list(range(16))  # four blocks: the first two held, the last two fetched
    hashes, tokens = landing(prefix)
    writes: list[tuple[list[int], int]] = []
    assert bm.land_prefix(hashes, tokens, 2, lambda ids, off: writes.append((ids, off))) == 4
    [(ids, offset)] = writes
    assert len(ids) == 2 and not set(ids) & set(held) and offset == 0
    assert [bm.cached[h] for h in hashes] == held + ids
    assert bm.drain_events() == [("stored", h) for h in hashes[2:]]
    bm.check_no_leaks()  # nothing stays referenced: free but findable
    b = seq(prefix + [99], "b")
    bm.allocate(b)
    assert b.block_table[:4] == held + ids and b.num_cached_tokens == 16
    assert bm.stats.hits == 16  # the landing itself is no query of the prefix cache


def test_land_prefix_lands_what_fits_and_never_evicts_the_head_it_extends():
    bm = BlockManager(4, BS)
    a = seq(list(range(5)), "a")  # one block held, cached and free
    bm.allocate(a)
    computed(bm, a)
    head = a.block_table[0]
    bm.free_sequence(a)
    other = seq([50 + i for i in range(8)], "o")  # two blocks held by a running request
    bm.allocate(other)
    hashes, tokens = landing(list(range(20)))  # five blocks: one held, four fetched
    written: list[int] = []
    landed = bm.land_prefix(hashes, tokens, 1, lambda ids, off: written.extend(ids))
    # two blocks are not the running request's: the head, kept, and one fresh block
    assert landed == 2 and bm.cached[hashes[0]] == head and len(written) == 1
    assert hashes[2] not in bm.cached
    bm.free_sequence(other)
    bm.check_no_leaks()


def test_land_prefix_lands_nothing_past_a_gap_or_a_failed_write():
    bm = BlockManager(8, BS)
    hashes, tokens = landing(list(range(12)))
    calls: list[int] = []
    # the caller holds blocks 1 on, but the engine lost block 0 since: nothing to chain to
    assert bm.land_prefix(hashes, tokens, 1, lambda ids, off: calls.append(1)) == 0
    assert calls == [] and not bm.cached

    def broken(ids: list[int], offset: int) -> None:
        raise RuntimeError("torn copy")

    with pytest.raises(RuntimeError):
        bm.land_prefix(hashes, tokens, 0, broken)
    assert not bm.cached and bm.num_free_blocks == 8  # unnamed, freed: never served
    bm.check_no_leaks()
    # prefix caching off: nothing is ever named
    off = BlockManager(8, BS, enable_prefix_caching=False)
    assert off.land_prefix(hashes, tokens, 0, lambda ids, o: calls.append(1)) == 0
