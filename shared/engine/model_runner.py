"""Turns a scheduled batch into model inputs, runs the model, and returns the logits needed.

It owns the model and the KV pool; it knows nothing of requests' lifecycles.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenyard.engine.scheduler import ScheduledSeq
from tokenyard.models.attention import AttnMetadata, PrefillSpan
from tokenyard.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from tokenyard.engine.lora import LoRAManager


@dataclass
class StepLogits:
    # [num completing sequences, vocab]: the next-token logits of each sequence that reached
    # its last token in this step, in the order of `completing`.
    logits: torch.Tensor
    completing: list[ScheduledSeq]
    # per sequence that asked for prompt logprobs: (first prompt position, logits [n, vocab])
    prompt_rows: list[tuple[ScheduledSeq, int, torch.Tensor]]
    # per completing sequence, in the same order: [k, vocab] logits of the rows after its k
    # speculative tokens (k = 0 when it had none)
    spec_logits: list[torch.Tensor] = field(default_factory=list)
    # per pooling sequence in the batch (engine/pooling.py): the final hidden states of the
    # prompt rows it needs, fp32 on the host ([num_tokens, hidden] for mean, [1, hidden] for
    # last, where only its last row matters)
    pooled: list[tuple[ScheduledSeq, torch.Tensor]] = field(default_factory=list)


@dataclass
class InputSpan:
    """Consecutive tokens of one sequence that one forward pass computes."""

    token_ids: list[int]
    start: int  # the position of the first
    block_table: list[int]  # covers every position up to start + len(token_ids)
    prompt: bool = False  # the span holds prompt tokens (AttnMetadata.prompt_step)
    lora: str = ""  # the LoRA adapter its rows run on ("" = the base model)


@dataclass
class StepPlan:
    """What every tensor-parallel rank must compute for one step: the spans' forward pass,
    then one lm_head call per group of rows (empty groups are skipped)."""

    spans: list[InputSpan]
    logit_rows: list[list[int]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        per_token_attention: bool = False,
        broadcast: Callable[[StepPlan], None] | None = None,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        self.block_size = block_size
        # Deterministic mode: every token, prompt tokens too, attends as a decode row of its
        # own (one query over its context), so a token's attention is the same computation
        # whether it arrives in a prefill chunk of any size, after a cache hit, or decoding.
        self.per_token_attention = per_token_attention
        # Tensor parallelism: sends each step's plan to the other ranks (None on one rank).
        self.broadcast = broadcast
        # LoRA adapters (engine/lora.py): each step's rows grouped by adapter slot.
        self.lora = lora

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> StepLogits:
        # Decode rows (one token each) first, so they form one batched attention call.
        batch = sorted(batch, key=lambda s: s.num_tokens + len(s.spec_token_ids) != 1)
        spans = [_span(s) for s in batch]
        ends = [e - 1 for e in itertools.accumulate(len(sp.token_ids) for sp in spans)]
        # A pooling sequence samples nothing: its hidden rows are its answer.
        completing = [i for i, s in enumerate(batch) if s.completes and not s.seq.params.pooling]
        # Per completing sequence: the row of its last token, then one row per speculative
        # token after it (rows [end - k, end]).
        ks = [len(batch[i].spec_token_ids) for i in completing]
        rows = [
            r for i, k in zip(completing, ks, strict=True) for r in range(ends[i] - k, ends[i] + 1)
        ]
        prompt = [
            (s, end)
            for s, end in zip(batch, ends, strict=True)
            if s.seq.params.prompt_logprobs is not None
            and s.seq.num_computed_tokens < s.seq.num_prompt_tokens
        ]
        plan = StepPlan(
            spans, [rows, *(list(range(end + 1 - s.num_tokens, end + 1)) for s, end in prompt)]
        )
        if self.broadcast is not None:
            self.broadcast(plan)
        # NOTE: sampling runs on the host: the logits of the completing rows only come back.
        hidden, outs = self._compute(plan)
        logits, *prompt_logits = (t.cpu() for t in outs)
        pooled = [
            (s, hidden[end + 1 - _pooled_rows(s) : end + 1].float().cpu())
            for s, end in zip(batch, ends, strict=True)
            if s.seq.params.pooling
        ]
        starts = list(itertools.accumulate((k + 1 for k in ks), initial=0))[:-1]
        spec_logits = [logits[f + 1 : f + 1 + k] for f, k in zip(starts, ks, strict=True)]
        prompt_rows = []
        for (s, _), s_logits in zip(prompt, prompt_logits, strict=True):
            assert not s.spec_token_ids, "drafts only follow a sequence's prompt"
            prompt_rows.append((s, s.seq.num_computed_tokens, s_logits))
        if any(ks):
            logits = logits[starts]
        completing_seqs = [batch[i] for i in completing]
        return StepLogits(logits, completing_seqs, prompt_rows, spec_logits, pooled)

    @torch.inference_mode()
    def compute(self, plan: StepPlan) -> list[torch.Tensor]:
        """Every rank's part of a step: the forward pass, then the plan's logits rows."""
        return self._compute(plan)[1]

    def _compute(self, plan: StepPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        hidden, _ = self.forward(plan.spans)  # [T, hidden]
        logits = [
            self.model.logits(hidden[rows]) if rows else hidden.new_empty(0, 0)
            for rows in plan.logit_rows
        ]
        return hidden, logits

    @torch.inference_mode()
    def forward(self, spans: list[InputSpan]) -> tuple[torch.Tensor, list[int]]:
        """Run the spans (single-token spans first) -> (hidden [T, hidden], each span's last row)."""
        input_ids, positions, meta, ends = _prepare(
            spans, self.block_size, self.per_token_attention
        )
        if self.lora is not None:
            rows = [(span.lora, len(span.token_ids)) for span in spans]
            self.lora.prepare_step(rows, meta.prompt_step)
        if self.kv_cache.device.type != "cpu":
            input_ids, positions, meta = _to_device(
                self.kv_cache.device, input_ids, positions, meta
            )
        return self.model(input_ids, positions, meta, self.kv_cache), ends


def _pooled_rows(s: ScheduledSeq) -> int:
    """The rows of this step a pooling sequence needs: all of them (mean), or its last."""
    return s.num_tokens if s.seq.params.pooling == "mean" else 1


def _span(s: ScheduledSeq) -> InputSpan:
    start = s.seq.num_computed_tokens
    tokens = s.seq.token_ids[start : start + s.num_tokens] + s.spec_token_ids
    prompt = start < s.seq.num_prompt_tokens
    return InputSpan(tokens, start, s.seq.block_table, prompt, s.seq.params.lora)


def _prepare(
    spans: list[InputSpan], bs: int, per_token: bool = False
) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, list[int]]:
    ids: list[int] = []
    pos: list[int] = []
    slot_blocks: list[int] = []
    prefills: list[PrefillSpan] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    ends: list[int] = []
    for span in spans:
        start, n = span.start, len(span.token_ids)
        end = start + n
        row = len(ids)
        ids.extend(span.token_ids)
        pos.extend(range(start, end))
        slot_blocks.extend(span.block_table[p // bs] for p in range(start, end))
        ends.append(row + n - 1)
        n_blocks = -(-end // bs)
        if n == 1 or per_token:
            assert not prefills, "single-token spans must come first"
            for p in range(start + 1, end + 1):  # p: the context length of each token
                decode_tables.append(span.block_table[: -(-p // bs)])
                decode_lens.append(p)
        else:
            block_ids = torch.tensor(span.block_table[:n_blocks], dtype=torch.long)
            prefills.append(PrefillSpan(row, n, end, block_ids, span.prompt))
    positions = torch.tensor(pos, dtype=torch.long)
    meta = AttnMetadata(
        slot_blocks=torch.tensor(slot_blocks, dtype=torch.long),
        slot_offsets=positions % bs,
        num_decode=len(decode_tables),
        prefills=prefills,
        block_size=bs,
        prompt_step=any(span.prompt for span in spans),
    )
    if decode_tables:
        width = max(len(t) for t in decode_tables)
        meta.decode_block_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long
        )
        meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.long)
    return torch.tensor(ids, dtype=torch.long), positions, meta, ends


def _to_device(
    device: torch.device, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata
) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata]:
    """A step's inputs, built on the host, moved to the pool's device in one pass."""

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    moved = AttnMetadata(
        slot_blocks=move(meta.slot_blocks),
        slot_offsets=move(meta.slot_offsets),
        num_decode=meta.num_decode,
        decode_block_tables=None
        if meta.decode_block_tables is None
        else move(meta.decode_block_tables),
        decode_context_lens=None
        if meta.decode_context_lens is None
        else move(meta.decode_context_lens),
        prefills=[
            PrefillSpan(p.start, p.num_tokens, p.context_len, move(p.block_ids), p.prompt)
            for p in meta.prefills
        ],
        block_size=meta.block_size,
        prompt_step=meta.prompt_step,
    )
    return move(input_ids), move(positions), moved
