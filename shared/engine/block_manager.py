"""The paged KV pool's bookkeeping: which physical block holds which tokens.

    sequence tokens:  [t0 ... t15][t16 ... t31][t32 t33 t34]
    block_table:      [    7     ][    2      ][    9       ]   (physical block ids)
    slot of t33:      block_table[33 // 16] * 16 + 33 % 16 = 9 * 16 + 1

Full blocks are named by ``block_hash(parent, tokens)`` once their KV has been computed, and
stay findable after their last user frees them: a free block keeps its hash until it is
reused for other tokens (least recently freed first). A new sequence whose leading blocks'
hashes are known takes those blocks (ref_count + 1) instead of computing them again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenyard.engine.outputs import NoFreeBlocks
from tokenyard.engine.sequence import Sequence
from tokenyard.kv.hashing import block_hash, salted_root


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = ()  # the tokens behind `hash`, to rule out collisions


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    # Whether freed cached blocks stay while never-written blocks remain: the prefix cache
    # then fills the whole pool, and a lazily resident pool becomes resident in full. False:
    # the oldest cached block is reused first, so the resident pool follows the peak of the
    # live sequences (for a worker whose blocks are also kept by the KV-cache service).
    grow_for_cache: bool = True
    blocks: list[Block] = field(init=False)
    # Free written blocks in reuse order: those holding nothing first, then cached ones,
    # least recently freed first.
    free: OrderedDict[int, None] = field(init=False)
    untouched: list[int] = field(init=False)  # free blocks never written, next one last
    cached: dict[int, int] = field(init=False)  # hash -> block id
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    # ("stored" | "removed", hash) in order, for the router's global block index.
    events: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free = OrderedDict()
        self.untouched = list(reversed(range(self.num_blocks)))
        self.cached = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.untouched)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- admission ------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        # NOTE: conservative: cached blocks sitting in the free list count as needed too.
        return self.blocks_needed(seq.num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, *, use_cache: bool = True) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix."""
        assert not seq.block_table
        # At least one token must run through the model to produce logits, so a block holding
        # the last token is never taken from the cache (and a shared block is never written).
        n_cacheable = (seq.num_tokens - 1) // self.block_size
        parent = salted_root(seq.params.prefix_salt)
        cache_hit = self.enable_prefix_caching and use_cache
        for i in range(self.blocks_needed(seq.num_tokens)):
            block_id = None
            if cache_hit and i < n_cacheable:
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                h = block_hash(parent, tokens)
                block_id = self._lookup(h, tokens)
                if block_id is None:
                    cache_hit = False
                else:
                    self._take(block_id)
                    seq.block_hashes.append(h)
                    parent = h
            if block_id is None:
                block_id = self._take_fresh()
            seq.block_table.append(block_id)
        num_cached = len(seq.block_hashes) * self.block_size
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
        self.stats.queries += seq.num_prompt_tokens
        self.stats.hits += seq.num_cached_tokens

    def _lookup(self, h: int, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(h)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        if not self.num_free_blocks:
            raise NoFreeBlocks("the KV block pool is full")
        block_id = self._next_free()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash is not None:  # evict its cached content
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                self.events.append(("removed", block.hash))
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def _next_free(self) -> int:
        """A written block holding nothing, else an untouched block, else the least recently
        freed cached block (with grow_for_cache off, a cached block before an untouched one)."""
        front = next(iter(self.free), None)
        if front is not None and (
            self.blocks[front].hash is None or not self.untouched or not self.grow_for_cache
        ):
            del self.free[front]
            return front
        return self.untouched.pop()

    def allocate_fresh(self, seq: Sequence, num_blocks: int) -> None:
        """Give `seq` `num_blocks` new, uncached blocks (the destination of a KV import)."""
        assert not seq.block_table
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocks(f"{num_blocks} blocks needed, {self.num_free_blocks} free")
        seq.block_table = [self._take_fresh() for _ in range(num_blocks)]

    def land_prefix(
        self,
        hashes: list[int],
        tokens: list[tuple[int, ...]],
        first: int,
        write: Callable[[list[int], int], None],
    ) -> int:
        """Name blocks of a prefix whose KV comes from outside (the KV-cache service),
        in one go; returns how many leading blocks of the prefix the cache now holds.

        ``hashes[i]``/``tokens[i]`` are the prefix's blocks; the caller holds the KV of
        blocks ``first`` on. Blocks already cached are kept (pinned while this runs, never
        written); fresh blocks take the rest, as many as the pool has room for, and
        ``write(block_ids, offset)`` fills them from the caller's block ``offset`` (relative
        to ``first``) on. Then they are named and freed: unreferenced but findable, like a
        finished request's blocks, so the next allocate() of that prompt takes them.
        A prefix whose cached head ends before ``first`` (evicted since) lands nothing."""
        if not self.enable_prefix_caching:
            return 0
        local = 0
        for h, t in zip(hashes, tokens, strict=True):
            if self._lookup(h, t) is None:
                break
            local += 1
        if local < first or local == len(hashes):
            return local
        held = [self.cached[h] for h in hashes[:local]]
        for block_id in held:
            self._take(block_id)
        end = min(len(hashes), local + self.num_free_blocks)
        fresh = [self._take_fresh() for _ in range(end - local)]
        try:
            if fresh:
                write(fresh, local - first)
            for i, block_id in zip(range(local, end), fresh, strict=True):
                h, block = hashes[i], self.blocks[block_id]
                if h in self.cached:
                    continue  # an equal block is already named; ours stays anonymous
                block.hash, block.token_ids = h, tokens[i]
                self.cached[h] = block_id
                self.events.append(("stored", h))
        finally:
            self._release(held + fresh)
        return end

    def _release(self, block_table: list[int]) -> None:
        # Reversed: a sequence's tail is the least likely to be shared, so it is evicted first.
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:  # holds nothing: reuse it first, its pages are resident
                    self.free.move_to_end(block_id, last=False)

    # --- growth during decode -------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_short(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens beyond those already computed."""
        for _ in range(self._blocks_short(seq, num_new_tokens)):
            seq.block_table.append(self._take_fresh())

    def trim(self, seq: Sequence) -> None:
        """Free blocks past the sequence's last token: slots reserved for drafted tokens that
        the target rejected (speculative decoding's rollback)."""
        keep = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, "a drafted slot was shared"
            block.ref_count = 0
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)  # holds nothing: reuse it first

    def _blocks_short(self, seq: Sequence, num_new_tokens: int) -> int:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, need - len(seq.block_table))

    # --- after a step ---------------------------------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Name each block that just became full of computed KV, so others can share it."""
        if not self.enable_prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else salted_root(seq.params.prefix_salt)
        for i in range(len(seq.block_hashes), n_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(parent, tokens)
            seq.block_hashes.append(h)
            parent = h
            block = self.blocks[seq.block_table[i]]
            if h in self.cached or block.hash is not None:
                continue  # an equal block is already named; ours stays anonymous
            block.hash, block.token_ids = h, tokens
            self.cached[h] = block.block_id
            self.events.append(("stored", h))

    # --- release --------------------------------------------------------------------------

    def free_sequence(self, seq: Sequence) -> None:
        self._release(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0

    def drain_events(self) -> list[tuple[str, int]]:
        events, self.events = self.events, []
        return events

    def check_no_leaks(self) -> None:
        """Every block free and unreferenced: the state after all sequences are gone."""
        assert self.num_free_blocks == self.num_blocks, (
            f"{self.num_blocks - self.num_free_blocks} blocks still held"
        )
        assert all(b.ref_count == 0 for b in self.blocks)
