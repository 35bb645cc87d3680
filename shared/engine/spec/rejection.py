"""Which drafted tokens the target keeps: the acceptance rule, written out once.

For draft tokens d_1..d_k, the target's one verification pass gives its distributions
p_1..p_{k+1} (p_i over the token after the first i - 1 drafts). Walking left to right:

- greedy: keep d_i while d_i == argmax p_i; the first mismatch is replaced by argmax p_i.
  The output is exactly what greedy decoding gives one token at a time.
- sampled (Leviathan et al., 2023; Chen et al., 2023): keep d_i with probability
  min(1, p_i(d_i) / q_i(d_i)), where q_i is the distribution the draft drew d_i from (a
  point mass for prompt lookup). On the first rejection draw the replacement from the
  residual max(p_i - q_i, 0), renormalized, and stop. Kept tokens plus that draw are then
  distributed exactly as k + 1 draws from the target alone would be.

When every draft is kept, one more "bonus" token is drawn from p_{k+1}: a step always emits
between 1 and k + 1 tokens.
"""

from __future__ import annotations

import torch

from tokenyard.engine.sampler import greedy_tokens


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits: [k + 1, vocab], the target's raw rows -> the tokens greedy decoding emits."""
    best = greedy_tokens(logits).tolist()
    emitted = []
    for draft, target in zip(drafts, best, strict=False):
        if draft != target:
            break
        emitted.append(draft)
    return emitted + [best[len(emitted)]]


def verify_sampled(
    probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """probs: [k + 1, vocab] the target's (filtered) distributions; draft_probs: [k, vocab]
    the draft's, None for drafts proposed without a distribution (a point mass each)."""
    k = len(drafts)
    d = torch.tensor(drafts, dtype=torch.long)
    rows = torch.arange(k)
    p_d = probs[rows, d]
    q_d = draft_probs[rows, d] if draft_probs is not None else torch.ones(k, dtype=probs.dtype)
    u = torch.rand(k, generator=generator, dtype=probs.dtype)
    # Accept d_i when u_i < p/q; written as u * q < p so q_i(d_i) = 0 cannot divide.
    rejected = (u * q_d >= p_d).nonzero()
    if not len(rejected):
        return drafts + [_draw(probs[k], generator)]
    a = int(rejected[0])
    if draft_probs is not None:
        residual = probs[a] - draft_probs[a]
    else:
        residual = probs[a].clone()
        residual[d[a]] -= 1.0
    residual = residual.clamp(min=0)
    if float(residual.sum()) <= 0:  # p == q up to rounding: no mass left to move
        residual = probs[a]
    return drafts[:a] + [_draw(residual / residual.sum(), generator)]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
