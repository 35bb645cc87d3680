"""From logits to the next token of every sequence in the batch.

Order (as in vLLM): penalties on the raw logits, then temperature, then top-k / top-p /
min-p filtering, then a draw. Logprobs are reported from the model's own distribution
(log-softmax of the raw logits), before any of that processing.

A seeded request draws with a generator seeded by (seed, output position), so its text does
not depend on its batch neighbours, on preemption, or on which worker runs which step.
"""

from __future__ import annotations

from collections import Counter

import torch

from tokenyard.engine.outputs import TokenLogprob
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.engine.sequence import Sequence
from tokenyard.kernels import cpu as cpu_kernels

_SEED_MIX = 0x9E3779B97F4A7C15  # the golden-ratio constant: spreads nearby seeds apart


def sample(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [B, vocab] fp32, one row per sequence -> (token ids, logprobs or None)."""
    params = [s.params for s in seqs]
    raw = logits
    if any(p.has_penalties for p in params):
        logits = _apply_penalties(logits.clone(), seqs)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy) == len(seqs):  # all greedy: no copy of the rows (6 MiB at 32 x 49,152)
        token_list = greedy_tokens(logits).tolist()
        return token_list, chosen_logprobs(raw, token_list, [p.logprobs for p in params])
    tokens = torch.empty(len(seqs), dtype=torch.long)
    if greedy:
        tokens[greedy] = greedy_tokens(logits[greedy])
    rest = [i for i, p in enumerate(params) if not p.greedy]
    if rest:
        probs = filtered_probs(logits[rest], [params[i] for i in rest])
        tokens[rest] = _draw(probs, [seqs[i] for i in rest])
    token_list = tokens.tolist()
    return token_list, chosen_logprobs(raw, token_list, [p.logprobs for p in params])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first highest-scoring token, as argmax gives it: on a CPU our kernel
    (`argmax_rows`, a few times faster than torch's max(dim) in a decode step:
    docs/benchmarks.md), else `max(dim).indices` (the same index, ties to the first;
    torch's CPU argmax is slower still)."""
    kernels = cpu_kernels.ops_for(logits)
    if kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2:
        return kernels.argmax_rows(logits.contiguous())
    return logits.max(dim=-1).indices


def chosen_logprobs(
    logits: torch.Tensor, token_ids: list[int], wants: list[int | None]
) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(token_ids)
    rows = [i for i, n in enumerate(wants) if n is not None]
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows], dim=-1)
    top_n = max(wants[i] or 0 for i in rows)
    top_vals, top_ids = logp.topk(top_n, dim=-1) if top_n else (None, None)
    for j, i in enumerate(rows):
        top: list[tuple[int, float]] = []
        if wants[i]:
            assert top_ids is not None and top_vals is not None
            n = wants[i] or 0
            top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist(), strict=True))
        out[i] = TokenLogprob(token_ids[i], float(logp[j, token_ids[i]]), top)
    return out


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:  # over prompt and output, as in HF and vLLM
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            row = logits[i, seen]
            logits[i, seen] = torch.where(
                row > 0, row / p.repetition_penalty, row * p.repetition_penalty
            )
        if p.presence_penalty or p.frequency_penalty:  # over the output only, as in OpenAI
            counts = Counter(seq.output_token_ids)
            if counts:
                ids = torch.tensor(list(counts), dtype=torch.long)
                freq = torch.tensor(list(counts.values()), dtype=logits.dtype)
                logits[i, ids] -= p.frequency_penalty * freq + p.presence_penalty
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    logits = logits / temps
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)[:, None]
    if bool((min_p > 0).any()):
        keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= ks
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)[:, None]
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
    # already does. The first token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _draw(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p; with a seeded E per
    # row, each seeded row is reproducible on its own.
    noise = torch.empty_like(probs)
    for i, seq in enumerate(seqs):
        noise[i].exponential_(generator=request_generator(seq))
    return (probs / noise).argmax(dim=-1)


def request_generator(seq: Sequence, stream: int = 0) -> torch.Generator | None:
    """The generator of a seeded request's next draw (None: the global one, unseeded).
    Another `stream` gives an independent generator for the same step (a draft model's)."""
    if seq.params.seed is None:
        return None
    seed = _step_seed(seq.params.seed, seq.num_output_tokens) ^ (stream * _SEED_MIX)
    return torch.Generator().manual_seed(seed & ((1 << 63) - 1))


def _step_seed(seed: int, position: int) -> int:
    return ((seed * _SEED_MIX) ^ (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1)
