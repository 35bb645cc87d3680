"""Continuous batching under a per-step token budget.

Each step: running sequences first (one token each when decoding, the next chunk when a long
prompt is still prefilling), then waiting ones in arrival order while budget, sequence slots
and blocks last. When a running sequence needs a block and none is free, the most recently
admitted running sequence is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed (its prompt and its output so far) later. Nothing starves:
the queue is first come, first served and a preempted sequence keeps its place. The one
exception: a waiting sequence whose prompt's leading blocks a running sequence is computing
right now waits for them (a step or a few), and then shares them through the prefix cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenyard.engine.block_manager import BlockManager
from tokenyard.engine.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens of this sequence computed in this step
    # Drafted tokens verified after the last one (tokenyard.engine.spec); their K/V is
    # written too, and rolled back past the first one the target rejects.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """True when this step reaches the sequence's last token: a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (an imported KV hand-off)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pending_prompt_tokens(self) -> int:
        """Prompt tokens not computed yet, over every queued or part-prefilled sequence."""
        return sum(
            max(0, s.num_prompt_tokens - s.num_computed_tokens)
            for s in (*self.waiting, *self.running)
        )

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        # running
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != Status.RUNNING:
                continue  # preempted below in this same loop
            n = min(seq.num_uncomputed_tokens, budget)
            spec = _spec_tokens(seq, n, budget)
            while not self.block_manager.can_append(seq, n + len(spec)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            self.block_manager.append_slots(seq, n + len(spec))
            batch.append(ScheduledSeq(seq, n, spec))
            budget -= n + len(spec)
        # waiting: none admitted in a step that had to preempt, or it would thrash
        for seq in list(self.waiting):
            if budget == 0 or preempted or len(self.running) >= self.max_num_seqs:
                break
            if self._prefix_in_flight(seq):
                continue  # admitted once that prefix is computed, then shared
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq, use_cache=_uses_cache(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """True when a running sequence is still computing full blocks of this sequence's
        prompt (the choices of an `n` > 1 request, or equal prompts arriving together):
        admitted now, it would compute them a second time; a step later it shares them."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or not _uses_cache(seq):
            return False
        cacheable = (seq.num_tokens - 1) // bm.block_size * bm.block_size
        head = seq.token_ids[: bm.block_size]
        for other in self.running:
            if (
                other.num_computed_tokens < cacheable
                and other.num_uncomputed_tokens > 1  # still prefilling (or recomputing)
                and other.token_ids[: bm.block_size] == head
                and other.params.cache_salt == seq.params.cache_salt
                and _common_prefix(other.token_ids, seq.token_ids) > other.num_computed_tokens
            ):
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids = []
        self.block_manager.free_sequence(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, *, keep_blocks: bool = False) -> None:
        """Take `seq` out of the queues; free its blocks unless they are kept for a transfer."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table and not keep_blocks:
            self.block_manager.free_sequence(seq)
        seq.status = Status.HELD if keep_blocks else Status.FINISHED
        seq.finish_reason = reason


def _uses_cache(seq: Sequence) -> bool:
    # Prompt logprobs and mean pooling need every prompt token to run through the model.
    return seq.params.prompt_logprobs is None and seq.params.pooling != "mean"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _spec_tokens(seq: Sequence, n: int, budget: int) -> list[int]:
    """The sequence's drafted tokens, taken for this step when they fit its budget."""
    spec, seq.spec_token_ids = seq.spec_token_ids, []
    if n != seq.num_uncomputed_tokens or n + len(spec) > budget:
        return []
    return spec
