"""Continuous batching under a per-step token budget.

Each step: running sequences first (one token each when decoding, the next chunk when a long
prompt is still prefilling), then waiting ones in the waiting queue's order while budget,
sequence slots and blocks last. That order (engine/fair_queue.py) is by `priority` (lower
first), then a fair share of tokens between tenants, then arrival; the "fcfs" policy keeps
plain arrival order. When a running sequence needs a block and none is free, the least
urgent running sequence (the most recently admitted of its class) is preempted: its blocks
are freed and it goes back to the queue to be recomputed (its prompt and its output so far)
later, keeping its arrival. A waiting sequence more urgent than a running one that finds no
slot or no blocks preempts the least urgent running one at the start of a step. Under the
"fair" policy the tenants of a class also share the slots (engine/slot_share.py): one at its
share is held back while one under it waits, and one under its share that finds no slot
preempts the newest running sequence of the tenant most over it; decodes get the budget
first, then prefill chunks by tenant, so a quiet prompt is chunked beside noisy ones. Within a
class nothing starves: a tenant's virtual time only grows as it is served. The one
exception: a waiting sequence whose prompt's leading blocks a running sequence is computing
right now waits for them (a step or a few), and then shares them through the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenyard.engine.block_manager import BlockManager
from tokenyard.engine.fair_queue import FairQueue, Policy, QueueKey
from tokenyard.engine.outputs import TenantQueueStats
from tokenyard.engine.sequence import Sequence, Status
from tokenyard.engine.slot_share import SlotShares

if TYPE_CHECKING:
    from tokenyard.engine.lora import LoRAManager


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
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: Policy = "fair",
        clock: Callable[[], float] = time.monotonic,
        lora: LoRAManager | None = None,
    ) -> None:
        self.block_manager = block_manager
        # LoRA slots (engine/lora.py): a running sequence pins its adapter's slot.
        self.lora = lora
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: FairQueue[Sequence] = FairQueue(_queue_key, _queue_cost, policy)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.clock = clock
        self.tenants: dict[str, TenantQueueStats] = {}  # cumulative, by tenant
        self._queued_at: dict[int, float] = {}  # id(seq) -> when it was first queued

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self._queued_at[id(seq)] = self.clock()
        self.waiting.push(seq)

    def tenant_stats(self) -> dict[str, TenantQueueStats]:
        """Per tenant: sequences waiting now, and the cumulative counters."""
        waiting = self.waiting.waiting_by_tenant()
        for tenant in waiting.keys() - self.tenants.keys():
            self.tenants[tenant] = TenantQueueStats()
        for tenant, stats in self.tenants.items():
            stats.num_waiting = waiting.get(tenant, 0)
        return {t: TenantQueueStats(**vars(s)) for t, s in self.tenants.items()}

    def add_running(self, seq: Sequence) -> None:
        """A sequence that already holds its blocks (an imported KV hand-off)."""
        self._pin_adapter(seq)
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
        if self.waiting.policy != "fcfs":
            # Most urgent first (stable: admission order within a class), so the least
            # urgent is last: the one preempted first, never one already in this batch.
            self.running.sort(key=lambda s: s.params.priority)
        # A waiting sequence that preempted running ones for itself (urgent, or under its
        # tenant's share of the slots): the one admitted this step.
        chosen = self._preempt_for_urgent() or self._preempt_for_share()
        favoured = chosen or self._next_under_share()
        preempted = False
        # running: decodes first, then prefill chunks (the fairest tenant's first), leaving
        # room for the prefill of a waiting sequence under its tenant's share
        for seq in self._running_in_turn():
            if budget == 0:
                break
            if seq.status != Status.RUNNING:
                continue  # preempted below in this same loop
            n = min(seq.num_uncomputed_tokens, budget)
            if n > 1 and favoured is not None and seq.params.tenant != favoured.params.tenant:
                n = min(n, budget - _reserve(favoured, self.max_num_batched_tokens))
                if n <= 0:
                    continue
            spec = _spec_tokens(seq, n, budget)
            while not self.block_manager.can_append(seq, n + len(spec)):
                victim = _last_unscheduled(self.running, batch, seq)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            self.block_manager.append_slots(seq, n + len(spec))
            batch.append(ScheduledSeq(seq, n, spec))
            budget -= n + len(spec)
        # waiting: none admitted in a step that had to preempt, or it would thrash; the
        # sequence that preempted others for itself is the exception
        shares = self._shares()
        for seq in _first(favoured, self.waiting.ordered()):
            if budget == 0 or len(self.running) >= self.max_num_seqs or preempted:
                break
            if chosen is not None and seq is not chosen:
                continue
            who = _who(seq)
            if shares is not None and shares.held_back(*who):
                continue  # its tenant has its share; the free slot is another's
            if self._prefix_in_flight(seq):
                continue  # admitted once that prefix is computed, then shared
            if not self._adapter_fits(seq):
                continue  # every LoRA slot is pinned by other adapters' running sequences
            if not self.block_manager.can_allocate(seq):
                break
            self._admit(seq)
            if shares is not None:
                shares.admit(*who)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        self._charge(batch)
        return batch

    def _running_in_turn(self) -> list[Sequence]:
        """The order running sequences get the step's budget in. Under the fair policy:
        decodes first (a token each, in running order), then prefill chunks by class and
        then by their tenant's virtual time, so a quiet tenant's long prompt is not
        chunked behind a noisy one's. Otherwise the running order."""
        if self.waiting.policy != "fair":
            return list(self.running)

        def turn(seq: Sequence) -> tuple[bool, int, int]:
            if seq.num_uncomputed_tokens <= 1:
                return (False, 0, 0)
            return (True, seq.params.priority, self.waiting.served(seq.params.tenant))

        return sorted(self.running, key=turn)

    def _preempt_for_urgent(self) -> Sequence | None:
        """Preempt running sequences of a less urgent class while the most urgent waiting
        one finds no slot or no blocks; that waiting one when any was preempted for it."""
        if self.waiting.policy == "fcfs" or not self.waiting or not self.running:
            return None
        if min(s.params.priority for s in self.waiting) >= self.running[-1].params.priority:
            return None  # nothing waits that outranks a running sequence (the common case)
        head = self.waiting.ordered()[0]
        urgent = None
        while self.running and not self._has_room(head):
            if self.running[-1].params.priority <= head.params.priority:
                break
            self._preempt(self.running[-1])
            urgent = head
        return urgent

    def _preempt_for_share(self) -> Sequence | None:
        """Fair policy: the first waiting sequence of the most urgent waiting class whose
        tenant is under its share of the slots (engine/slot_share.py), finding no slot or
        no blocks, preempts the newest running sequences of the tenant most over its share;
        that waiting one when any was preempted for it."""
        shares = self._shares()
        if shares is None or not self.running:
            return None
        seq = self._next_under_share(shares, needs_room=False)
        if seq is None or self._has_room(seq):
            return None  # admitted in turn: tenants at their share are held back for it
        priority, tenant = _who(seq)
        chosen = None
        while not self._has_room(seq):
            over = shares.victim(priority, tenant)
            if over is None:
                break
            victim = next(s for s in reversed(self.running) if _who(s) == (priority, over))
            self._preempt(victim)
            shares.preempt(priority, over)
            chosen = seq
        return chosen

    def _next_under_share(
        self, shares: SlotShares | None = None, *, needs_room: bool = True
    ) -> Sequence | None:
        """The waiting sequence of the most urgent waiting class whose tenant holds the
        fewest slots, under its share, that could start now but for a slot or blocks (the
        first of that tenant's in the queue's order); `needs_room`: only when a slot is
        free."""
        shares = shares or self._shares()
        if shares is None or (needs_room and len(self.running) >= self.max_num_seqs):
            return None
        top = min(s.params.priority for s in self.waiting)
        candidates = [
            seq
            for seq in self.waiting.ordered()
            if seq.params.priority == top
            and shares.under(*_who(seq))
            and not self._prefix_in_flight(seq)
            and self._adapter_fits(seq)
        ]
        # the tenant furthest under its share first (equal shares: the one holding least)
        return min(candidates, key=lambda s: shares.held[_who(s)], default=None)

    def _shares(self) -> SlotShares | None:
        """The tenants' shares of the slots now; None unless the policy is fair."""
        if self.waiting.policy != "fair" or not self.waiting:
            return None
        return SlotShares.of(map(_who, self.running), map(_who, self.waiting), self.max_num_seqs)

    def _has_room(self, seq: Sequence) -> bool:
        return len(self.running) < self.max_num_seqs and self.block_manager.can_allocate(seq)

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.block_manager.allocate(seq, use_cache=_uses_cache(seq))
        self._pin_adapter(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        queued_at = self._queued_at.pop(id(seq), None)
        if queued_at is not None:  # its first admission (not a recompute after preemption)
            stats = self.tenants.setdefault(seq.params.tenant, TenantQueueStats())
            stats.num_admitted += 1
            stats.wait_s_total += self.clock() - queued_at

    def _charge(self, batch: list[ScheduledSeq]) -> None:
        """Each tenant's fair-share clock advances by the tokens computed for it."""
        for s in batch:
            tokens = s.num_tokens + len(s.spec_token_ids)
            self.waiting.charge(s.seq.params.tenant, tokens)
            stats = self.tenants.setdefault(s.seq.params.tenant, TenantQueueStats())
            stats.num_tokens += tokens

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
                and other.params.prefix_salt == seq.params.prefix_salt
                and _common_prefix(other.token_ids, seq.token_ids) > other.num_computed_tokens
            ):
                return True
        return False

    def _adapter_fits(self, seq: Sequence) -> bool:
        return self.lora is None or not seq.params.lora or self.lora.can_pin(seq.params.lora)

    def _pin_adapter(self, seq: Sequence) -> None:
        if self.lora is not None and seq.params.lora:
            self.lora.pin(seq.params.lora)

    def _unpin_adapter(self, seq: Sequence) -> None:
        if self.lora is not None and seq.params.lora:
            self.lora.unpin(seq.params.lora)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._unpin_adapter(seq)
        seq.spec_token_ids = []
        self.block_manager.free_sequence(seq)
        seq.status = Status.WAITING
        self.waiting.push(seq, front=True)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, *, keep_blocks: bool = False) -> None:
        """Take `seq` out of the queues; free its blocks unless they are kept for a transfer."""
        if seq in self.running:
            self.running.remove(seq)
            self._unpin_adapter(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._queued_at.pop(id(seq), None)
        if seq.block_table and not keep_blocks:
            self.block_manager.free_sequence(seq)
        seq.status = Status.HELD if keep_blocks else Status.FINISHED
        seq.finish_reason = reason


def _who(seq: Sequence) -> tuple[int, str]:
    return seq.params.priority, seq.params.tenant


def _first(seq: Sequence | None, ordered: list[Sequence]) -> list[Sequence]:
    """The queue's order with `seq` (the favoured one) moved to its front."""
    if seq is None or seq not in ordered:
        return ordered
    return [seq, *(s for s in ordered if s is not seq)]


def _reserve(seq: Sequence, max_num_batched_tokens: int) -> int:
    """The budget kept for a favoured waiting sequence's prefill: what it needs, at most
    half the step."""
    return min(seq.num_uncomputed_tokens, max(1, max_num_batched_tokens // 2))


def _last_unscheduled(
    running: list[Sequence], batch: list[ScheduledSeq], seq: Sequence
) -> Sequence:
    """The running sequence preempted for memory: the least urgent (last) one not already
    in this step's batch; `seq` itself when every other one is."""
    scheduled = {id(s.seq) for s in batch}
    return next((s for s in reversed(running) if id(s) not in scheduled), seq)


def _queue_key(seq: Sequence) -> QueueKey:
    return QueueKey(seq.params.priority, seq.params.tenant, seq.arrival)


def _queue_cost(seq: Sequence) -> int:
    return seq.num_uncomputed_tokens


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
