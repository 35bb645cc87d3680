"""A request as the engine sees it: token ids and two counters, everything else derived.

There is no prefill phase and no decode phase: each step computes
``num_tokens - num_computed_tokens`` tokens of a sequence (capped by the step's budget).
A fresh prompt, a chunk of a long prompt, a prefix-cache hit, a recompute after preemption
and an ordinary decode step are all that one rule.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tokenyard.engine.outputs import TokenLogprob
from tokenyard.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tokenyard.engine.guided import Grammar
    from tokenyard.engine.stop import StopChecker
    from tokenyard.models.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks, scheduled every step
    IMPORTING = "importing"  # holds blocks that a KV transfer is filling; not scheduled
    HELD = "held"  # prefill-only request done; blocks kept for a KV transfer
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival: int,
        prefill_only: bool = False,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (last admission)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full blocks registered so far
        self.params = params
        self.arrival = arrival  # admission order: FCFS and preemption pick by it
        self.prefill_only = prefill_only
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.stop_checker: StopChecker | None = None
        self.grammar: Grammar | None = None  # guided decoding's state (engine/guided.py)
        self.text = ""  # output text released to the caller so far
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        # Speculative decoding: tokens drafted for the next step, and how many of this
        # sequence's tokens have K/V in the draft model's pool (same block table).
        self.spec_token_ids: list[int] = []
        self.num_draft_computed = 0
        # Pooling requests (engine/pooling.py): the sum of the prompt's final hidden states
        # so far (mean), or the last one's (last); [hidden] fp32.
        self.pooled: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
