"""The engine's one entry point to speculative decoding.

At the end of each step `propose` drafts tokens for the running sequences that are decoding
(`seq.spec_token_ids`); the scheduler schedules them after the sequence's last token when
the step's budget has room, the model runner computes logits for every one of those rows,
and `verify` keeps the longest prefix the target agrees with plus one token of its own.

Speculation is off for a step when the batch is large (`disable_by_batch_size`: the batch
already keeps the matmuls busy, and the verification rows cost more than they save), and
for requests with penalties (their distribution would change with every kept token).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenyard.engine.block_manager import BlockManager
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.model_runner import ModelRunner
from tokenyard.engine.sampler import chosen_logprobs, filtered_probs, request_generator
from tokenyard.engine.scheduler import ScheduledSeq
from tokenyard.engine.sequence import Sequence, Status, TokenLogprob
from tokenyard.engine.spec.config import SpeculativeConfig
from tokenyard.engine.spec.draft import DraftModel, build_draft
from tokenyard.engine.spec.ngram import propose_ngram
from tokenyard.engine.spec.rejection import verify_greedy, verify_sampled

log = logging.getLogger(__name__)


@dataclass
class SpecStats:
    num_drafts: int = 0  # verifications: sequences that had drafted tokens in a step
    num_draft_tokens: int = 0  # tokens drafted and verified
    num_accepted_tokens: int = 0  # of those, kept by the target
    num_disabled_steps: int = 0  # steps where the batch was too large to speculate

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: kept drafts plus the target's own token."""
        return (
            (self.num_accepted_tokens + self.num_drafts) / self.num_drafts
            if self.num_drafts
            else 0.0
        )


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        block_manager: BlockManager,
        max_model_len: int,
        draft: DraftModel | None = None,
        *,
        greedy_only: bool = False,
    ) -> None:
        assert (draft is None) == (config.method == "ngram")
        self.config = config
        # Deterministic mode: its batch-invariant kernels give a verification row the same
        # logits as a decode row, so greedy output cannot change; a sampled request's draws
        # would (rejection sampling against plain sampling), and whether a step speculates
        # depends on its neighbours (disable_by_batch_size).
        self.greedy_only = greedy_only
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.draft = draft
        self.stats = SpecStats()
        # The draft's distributions of this step's drafted tokens, for sampled requests.
        self._draft_probs: dict[str, torch.Tensor] = {}

    # --- after a step: draft for the next one ---------------------------------------------

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` of the running decoding sequences worth speculating on."""
        self._draft_probs = {}
        for seq in running:
            seq.spec_token_ids = []  # drafts of a sequence that was not scheduled: stale
            # draft K/V past the verified tokens is stale too
            seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
        if len(running) >= self.config.disable_by_batch_size:
            self.stats.num_disabled_steps += 1
            return
        seqs = [s for s in running if self._budget(s) > 0]
        if self.draft is None:
            for seq in seqs:
                seq.spec_token_ids = propose_ngram(
                    seq.token_ids,
                    self._budget(seq),
                    self.config.prompt_lookup_min,
                    self.config.prompt_lookup_max,
                )
            return
        self._propose_with_draft(seqs)

    def _propose_with_draft(self, seqs: list[Sequence]) -> None:
        k = self.config.num_speculative_tokens
        # The draft writes K/V up to d(k-1) and verification up to dk: reserve those slots now.
        seqs = [s for s in seqs if self.block_manager.can_append(s, 1 + k)]
        for seq in seqs:
            self.block_manager.append_slots(seq, 1 + k)
        assert self.draft is not None
        by_id = {s.request_id: s for s in seqs}
        for request_id, (tokens, probs) in self.draft.propose(seqs, k).items():
            seq = by_id[request_id]
            n = self._budget(seq)
            seq.spec_token_ids = tokens[:n]
            if probs is not None:
                self._draft_probs[request_id] = probs[:n]

    def _budget(self, seq: Sequence) -> int:
        """How many tokens to draft for `seq`: 0 unless it decodes and may speculate."""
        p = seq.params
        if seq.status != Status.RUNNING or seq.prefill_only or seq.num_uncomputed_tokens != 1:
            return 0
        if p.has_penalties or (self.greedy_only and not p.greedy):
            return 0
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    # --- in a step: keep what the target agrees with --------------------------------------

    def verify(
        self, s: ScheduledSeq, logits: torch.Tensor, spec_logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [vocab] after the last token; spec_logits: [k, vocab] after each draft ->
        (the tokens to emit, their logprobs)."""
        seq, drafts = s.seq, s.spec_token_ids
        rows = torch.cat([logits[None], spec_logits])  # [k + 1, vocab]
        if seq.params.greedy:
            emitted = verify_greedy(rows, drafts)
        else:
            q = self._draft_probs.pop(seq.request_id, None)
            assert q is not None or self.draft is None, "a drafted token without its distribution"
            probs = filtered_probs(rows, [seq.params] * len(rows))
            emitted = verify_sampled(probs, drafts, q, request_generator(seq))
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_tokens += len(emitted) - 1
        n = len(emitted)
        return emitted, chosen_logprobs(rows[:n], emitted, [seq.params.logprobs] * n)


def build_speculator(
    config: EngineConfig, runner: ModelRunner, block_manager: BlockManager, max_model_len: int
) -> Speculator | None:
    spec = config.speculative_config
    if spec is None:
        return None
    assert isinstance(spec, SpeculativeConfig)
    draft = None
    if spec.method == "draft":
        draft = build_draft(spec, runner.model, config, runner.kv_cache)
    log.info(
        "speculative decoding: %s, %d tokens, off from %d running sequences%s",
        spec.method,
        spec.num_speculative_tokens,
        spec.disable_by_batch_size,
        "" if draft is None else f"; draft {spec.model or 'self'} ({spec.quantization})",
    )
    return Speculator(spec, block_manager, max_model_len, draft, greedy_only=config.deterministic)
