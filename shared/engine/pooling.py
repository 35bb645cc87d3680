"""Embeddings from the served model: a pooling request's final hidden states, pooled.

A pooling request is an ordinary sequence whose prompt is computed (in chunks, batched with
other work) and whose last step samples nothing: each step adds its prompt rows here, and
the step that computes the last prompt token ends the request with the pooled vector.

    mean: the average of every prompt token's final hidden state (needs every row: the
          scheduler gives such a sequence no prefix-cache hits)
    last: the last prompt token's final hidden state
Either is L2-normalized. The hidden states are the model's output after its final norm,
which is what HF's `AutoModel(...).last_hidden_state` is.
"""

from __future__ import annotations

import torch

from tokenyard.engine.sequence import Sequence


def add_rows(seq: Sequence, hidden: torch.Tensor, start: int) -> None:
    """Fold in the final hidden states of prompt positions [start, start + n)."""
    # hidden: [n, hidden_size]
    rows = hidden.float()
    if seq.params.pooling == "last":
        seq.pooled = rows[-1].clone()
        return
    total = rows.sum(dim=0)
    if start == 0:  # the first chunk, or a recompute after preemption: start over
        seq.pooled = total
        return
    assert seq.pooled is not None, "mean pooling needs every prompt row (no cache hits)"
    seq.pooled += total


def embedding(seq: Sequence) -> list[float]:
    """The request's answer once its whole prompt is computed: pooled, then normalized."""
    assert seq.pooled is not None, "no prompt rows were computed"
    vector = seq.pooled
    if seq.params.pooling == "mean":
        vector = vector / seq.num_prompt_tokens
    return torch.nn.functional.normalize(vector, dim=0).tolist()
