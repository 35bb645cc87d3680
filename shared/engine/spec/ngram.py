"""Prompt lookup: guess that the text goes on the way it went after the same words before.

    tokens:   ... a b c d e ... x y a b c
                    ^^^^^ latest earlier match of the suffix "a b c"
    proposal: d e ...        (the k tokens that followed it)

Costs no model at all, and pays on copy-heavy work: summaries quoting their source, code
edits, extraction. The longest suffix (prompt_lookup_max) is tried first.
"""

from __future__ import annotations

import torch


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the sequence's suffix."""
    tokens = torch.tensor(token_ids, dtype=torch.long)
    total = len(token_ids)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        # windows[i] = tokens[i : i + n], for every start whose window ends before the suffix
        windows = tokens[: total - 1].unfold(0, n, 1)
        hits = (windows == suffix).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []
