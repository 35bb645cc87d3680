"""Per-request logit edits applied before sampling: OpenAI's `logit_bias` and vLLM's
`min_tokens`. The grammar masks of guided decoding live in guided.py.

Both act on a copy of the logits; logprobs are still reported from the model's own
distribution, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenyard.engine.sequence import Sequence


def needs_processing(seqs: list[Sequence]) -> bool:
    return any(s.params.logit_bias or _holds_back_stop(s) for s in seqs)


def apply_processors(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: Collection[int]
) -> torch.Tensor:
    """logits: [B, vocab], one row per sequence -> a copy with biases and bans applied."""
    if not needs_processing(seqs):
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, seq in enumerate(seqs):
        if seq.params.logit_bias:
            ids = torch.tensor(list(seq.params.logit_bias), dtype=torch.long)
            bias = torch.tensor(list(seq.params.logit_bias.values()), dtype=logits.dtype)
            logits[i, ids] += bias
        if _holds_back_stop(seq):
            banned = [t for t in {*eos_ids, *seq.params.stop_token_ids} if t < vocab]
            logits[i, banned] = float("-inf")
    return logits


def _holds_back_stop(seq: Sequence) -> bool:
    """Below `min_tokens`, neither EOS nor a stop token id may be drawn."""
    return seq.num_output_tokens < seq.params.min_tokens
