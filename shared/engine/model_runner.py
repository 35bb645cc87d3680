"""Turns a scheduled batch into model inputs, runs the model, and returns the logits needed.

It owns the model and the KV pool; it knows nothing of requests' lifecycles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenyard.engine.scheduler import ScheduledSeq
from tokenyard.models.attention import AttnMetadata, PrefillSpan
from tokenyard.models.llama import LlamaForCausalLM


@dataclass
class StepLogits:
    # [num completing sequences, vocab]: the next-token logits of each sequence that reached
    # its last token in this step, in the order of `completing`.
    logits: torch.Tensor
    completing: list[ScheduledSeq]
    # per sequence that asked for prompt logprobs: (first prompt position, logits [n, vocab])
    prompt_rows: list[tuple[ScheduledSeq, int, torch.Tensor]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        per_token_attention: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_blocks, num_layers, 2, block_size, H_kv, D]
        self.block_size = block_size
        # Deterministic mode: every token, prompt tokens too, attends as a decode row of its
        # own (one query over its context), so a token's attention is the same computation
        # whether it arrives in a prefill chunk of any size, after a cache hit, or decoding.
        self.per_token_attention = per_token_attention

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> StepLogits:
        # Decode rows (one token each) first, so they form one batched attention call.
        batch = sorted(batch, key=lambda s: s.num_tokens != 1)
        input_ids, positions, meta, last_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, meta, self.kv_cache)  # [T, hidden]
        completing = [s for s in batch if s.completes]
        rows = torch.tensor([last_rows[id(s)] for s in completing], dtype=torch.long)
        logits = self.model.logits(hidden[rows]) if completing else hidden.new_empty(0, 0)
        prompt_rows = []
        for s in batch:
            if (
                s.seq.params.prompt_logprobs is not None
                and s.seq.num_computed_tokens < s.seq.num_prompt_tokens
            ):
                end = last_rows[id(s)] + 1
                prompt_rows.append(
                    (
                        s,
                        s.seq.num_computed_tokens,
                        self.model.logits(hidden[end - s.num_tokens : end]),
                    )
                )
        return StepLogits(logits, completing, prompt_rows)

    def _prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttnMetadata, dict[int, int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slot_blocks: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        last_rows: dict[int, int] = {}
        for s in batch:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slot_blocks.extend(seq.block_table[p // bs] for p in range(start, end))
            last_rows[id(s)] = row + s.num_tokens - 1
            n_blocks = -(-end // bs)
            if s.num_tokens == 1 or self.per_token_attention:
                for p in range(start + 1, end + 1):  # p: the context length of each token
                    decode_tables.append(seq.block_table[: -(-p // bs)])
                    decode_lens.append(p)
            else:
                block_ids = torch.tensor(seq.block_table[:n_blocks], dtype=torch.long)
                prefills.append(PrefillSpan(row, s.num_tokens, end, block_ids))
        positions = torch.tensor(pos, dtype=torch.long)
        meta = AttnMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long),
            slot_offsets=positions % bs,
            num_decode=len(decode_tables),
            prefills=prefills,
            block_size=bs,
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = torch.tensor(
                [t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long
            )
            meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.long)
        return torch.tensor(ids, dtype=torch.long), positions, meta, last_rows
