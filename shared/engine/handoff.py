"""The prefill-to-decode hand-off, as the engine offers it to a worker.

    prefill worker                                   decode worker
    add_request(rid, prompt, prefill_only=True)
    step() ... -> finish_reason "prefilled"
    export_sequence(rid) -> ExportedSequence  ---->  import_sequence(rid, prompt, output,
       (its blocks stay held)                            params) -> fresh block ids
                                                     ... KV bytes copied into them ...
    release(rid)  <---- pulled (or timed out) -----  commit_import(rid, kv_ok)
                                                     step() ... decodes on

With ``kv_ok=False`` (the transfer failed) the decode side recomputes the prompt itself, so a
lost transfer costs time, never the request.

:class:`SequenceHandoff` is the engine's implementation (LLMEngine composes one). It also
keeps the KV-cache service's prefix reservations (tokenyard.kv.engine_port): they are
imports too, blocks whose KV is written from outside, in the same IMPORTING state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tokenyard.engine.block_manager import BlockManager
from tokenyard.engine.outputs import ExportedSequence, RequestIdInUse
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.engine.scheduler import Scheduler
from tokenyard.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from tokenyard.engine.guided import Guide

__all__ = ["ExportedSequence", "Handoff", "SequenceHandoff"]


class Handoff(Protocol):
    def export_sequence(self, request_id: str) -> ExportedSequence:
        """A finished prefill-only request's prompt, first token and blocks (still held)."""
        ...

    def release(self, request_id: str) -> None:
        """Free a held prefill's blocks (pulled, refused or timed out); a no-op otherwise."""
        ...

    def import_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
    ) -> list[int]:
        """Fresh blocks for a handed-off prompt's KV; the sequence waits for commit_import.

        Raises NoFreeBlocks when the pool is full, ValueError for a bad sequence."""
        ...

    def commit_import(self, request_id: str, kv_ok: bool) -> None:
        """Start decoding an imported sequence; kv_ok=False recomputes its prompt first."""
        ...


class SequenceHandoff:
    """The engine's side of sequences whose KV crosses its boundary, over the engine's parts:
    its request table, block manager and scheduler (shared, not copied)."""

    def __init__(
        self,
        seqs: dict[str, Sequence],
        arrivals: itertools.count[int],
        block_manager: BlockManager,
        scheduler: Scheduler,
        guide: Guide,
        *,
        attach_output_state: Callable[[Sequence], None],
        check_length: Callable[[int], None],
        vocab_size: int,
    ) -> None:
        self.seqs = seqs
        self.arrivals = arrivals
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.guide = guide
        self.attach_output_state = attach_output_state
        self.check_length = check_length
        self.vocab_size = vocab_size

    # --- the prefill side ----------------------------------------------------------------

    def export_sequence(self, request_id: str) -> ExportedSequence:
        seq = self.seqs[request_id]
        if seq.status != Status.HELD:
            raise ValueError(f"request {request_id!r} is not a finished prefill-only request")
        n_prompt_blocks = self.block_manager.blocks_needed(seq.num_prompt_tokens)
        return ExportedSequence(
            request_id=request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            block_ids=seq.block_table[:n_prompt_blocks],
            num_computed_tokens=seq.num_prompt_tokens,
            params=seq.params,
        )

    def release(self, request_id: str) -> None:
        """Free a held prefill-only request's blocks (after its KV was pulled, or on timeout)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status != Status.HELD:
            return
        del self.seqs[request_id]
        self.block_manager.free_sequence(seq)
        seq.status = Status.FINISHED

    # --- the decode side -----------------------------------------------------------------

    def import_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
    ) -> list[int]:
        """Blocks for a handed-off prompt's KV; the sequence waits for commit_import()."""
        if request_id in self.seqs:
            raise RequestIdInUse(request_id)
        if not prompt_token_ids or not output_token_ids:
            raise ValueError("an imported sequence needs its prompt and at least its first token")
        # NOTE: a hand-off comes off the bus, not through add_request's checks: an id past the
        # vocabulary would fail inside a later step and take every other sequence with it.
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in (*prompt_token_ids, *output_token_ids)):
            raise ValueError(f"token ids must be in [0, {vocab})")
        self.check_length(len(prompt_token_ids))
        seq = Sequence(request_id, prompt_token_ids, params, arrival=next(self.arrivals))
        self._allocate_computed(seq, len(prompt_token_ids))
        self.attach_output_state(seq)
        seq.token_ids.extend(output_token_ids)
        self.guide.attach(seq)  # replays the output tokens through the grammar
        assert seq.detokenizer is not None and seq.stop_checker is not None
        seq.text, _ = seq.stop_checker.feed(seq.detokenizer.push(output_token_ids), final=False)
        self.seqs[request_id] = seq
        return list(seq.block_table)

    def commit_import(self, request_id: str, kv_ok: bool) -> None:
        seq = self.seqs[request_id]
        assert seq.status == Status.IMPORTING
        if kv_ok:
            self.block_manager.register_computed(seq)
            self.scheduler.add_running(seq)
        else:  # the transfer failed: recompute the prompt (and the first token) here
            self.block_manager.free_sequence(seq)
            self.scheduler.add(seq)

    # --- the KV-cache service's prefixes (tokenyard.kv.engine_port) --------------------------

    def reserve_prefix(
        self, request_id: str, token_ids: list[int], cache_salt: str = ""
    ) -> list[int]:
        """Blocks for a prefix of whole blocks; :meth:`commit_prefix` names or drops them."""
        if request_id in self.seqs:
            raise RequestIdInUse(request_id)
        block_size = self.block_manager.block_size
        if not token_ids or len(token_ids) % block_size:
            raise ValueError(f"a prefix is whole blocks of {block_size} tokens")
        seq = Sequence(
            request_id,
            token_ids,
            SamplingParams(max_tokens=1, cache_salt=cache_salt),
            arrival=next(self.arrivals),
        )
        self._allocate_computed(seq, len(token_ids))  # never scheduled: abort() frees it
        self.seqs[request_id] = seq
        return list(seq.block_table)

    def commit_prefix(self, request_id: str, kv_ok: bool) -> None:
        seq = self.seqs.pop(request_id)
        assert seq.status == Status.IMPORTING
        if kv_ok:
            # Named, then freed: unreferenced but findable, like a finished request's blocks.
            self.block_manager.register_computed(seq)
        self.block_manager.free_sequence(seq)
        seq.status = Status.FINISHED

    def _allocate_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Fresh blocks for ``num_tokens`` whose KV is written from outside (IMPORTING)."""
        self.block_manager.allocate_fresh(seq, self.block_manager.blocks_needed(num_tokens))
        seq.num_computed_tokens = num_tokens
        seq.status = Status.IMPORTING
