"""A draft model: a smaller (or cheaper) model of the same vocabulary proposes k tokens.

Two kinds, chosen by `speculative_config["model"]`:

- None, self-speculation: the target's own weights with int4 copies of its projections
  (`quantize(..., keep_dense=True)` shares the target's dense tensors, so only the int4
  copies cost memory). It has the target's shape, so it reads and writes the target's own
  KV pool: the prompt's K/V is the target's, nothing is prefilled twice, and prefix-cache
  hits and KV hand-offs need nothing more. The K/V it writes for the drafted positions is
  overwritten by the verification pass, which writes its rows before attending.
- a path: another model with its own KV pool, indexed by the same block ids as the target's
  (so the block manager's bookkeeping holds for both). `seq.num_draft_computed` counts the
  tokens whose draft K/V is valid; the draft catches up from there (a prompt, a prefix-cache
  hit, an imported sequence, tokens decoded while speculation was off) before it drafts.

    draft step 1:  [catch-up tokens ... last token] -> d1
    draft step j:  [d(j-1)]                          -> dj      (one row per sequence)
"""

from __future__ import annotations

import copy

import torch

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.memory import build_model_and_pool, draft_weights_bytes, kv_layout
from tokenyard.engine.model_runner import InputSpan, ModelRunner
from tokenyard.engine.sampler import filtered_probs, request_generator
from tokenyard.engine.sequence import Sequence
from tokenyard.engine.spec.config import SpeculativeConfig
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.loader import load_model
from tokenyard.models.quantize import quantize

DRAFT_STREAM = 1  # the draft draws from its own seeded stream, independent of verification's


class DraftModel:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        shares_pool: bool,
        max_catch_up: int,
        weights_bytes: int,
    ) -> None:
        self.runner = runner
        self.shares_pool = shares_pool  # True: reads and writes the target's KV pool
        self.max_catch_up = max_catch_up  # draft tokens one step may spend catching up
        self.weights_bytes = weights_bytes  # what its weights add to the target's

    @property
    def kv_cache_bytes(self) -> int:
        """Its own KV pool's bytes: none when it writes the target's."""
        if self.shares_pool:
            return 0
        pool = self.runner.kv_cache
        return pool.numel() * pool.element_size()

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], k: int
    ) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """request id -> (k drafted tokens, the [k, vocab] distributions they were drawn from,
        None for greedy requests). Sequences still catching up are left out."""
        ready, spans = self._first_spans(seqs)
        if not ready:
            return {}
        logits = self._run(spans)
        drafts: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        gens = [request_generator(s, DRAFT_STREAM) for s in ready]
        for j in range(k):
            for i, seq in enumerate(ready):
                token, q = _draw(logits[i], seq, gens[i])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            if j == k - 1:
                break
            pos = [s.num_tokens + j for s in ready]
            logits = self._run(
                [
                    InputSpan([d[-1]], p, s.block_table)
                    for d, p, s in zip(drafts, pos, ready, strict=True)
                ]
            )
        if not self.shares_pool:
            for seq in ready:  # K/V now valid up to d(k-1), if the target keeps it
                seq.num_draft_computed = seq.num_tokens + k - 1
        return {
            s.request_id: (d, torch.stack(q) if q else None)
            for s, d, q in zip(ready, drafts, probs, strict=True)
        }

    def _first_spans(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[InputSpan]]:
        """The spans of the first draft pass, and which sequences will draft this step. A
        sequence more than `max_catch_up` tokens behind only catches up (no drafts)."""
        if self.shares_pool:
            return seqs, [
                InputSpan(s.token_ids[-1:], s.num_tokens - 1, s.block_table) for s in seqs
            ]
        budget = self.max_catch_up
        behind = []
        for seq in seqs:
            n = seq.num_tokens - seq.num_draft_computed
            if n > budget:
                behind.append(seq)
            else:
                budget -= n
        for seq in behind:  # a chunk of catch-up, within what the budget has left
            n = min(budget, seq.num_tokens - 1 - seq.num_draft_computed)
            if n > 0:
                self._run([_tail_span(seq, n)])
                seq.num_draft_computed += n
                budget -= n
        ready = [s for s in seqs if s not in behind]
        return ready, [_tail_span(s, s.num_tokens - s.num_draft_computed) for s in ready]

    def _run(self, spans: list[InputSpan]) -> torch.Tensor:
        """Last-row logits [len(spans), vocab] of each span, in the given order."""
        order = sorted(range(len(spans)), key=lambda i: len(spans[i].token_ids) != 1)
        hidden, ends = self.runner.forward([spans[i] for i in order])
        rows = [0] * len(spans)
        for i, end in zip(order, ends, strict=True):
            rows[i] = end
        return self.runner.model.logits(hidden[rows])


def _tail_span(seq: Sequence, n: int) -> InputSpan:
    start = seq.num_draft_computed
    return InputSpan(seq.token_ids[start : start + n], start, seq.block_table)


def _draw(
    logits: torch.Tensor, seq: Sequence, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    if seq.params.greedy:
        return int(logits.argmax()), None
    q = filtered_probs(logits[None], [seq.params])[0]
    return int(torch.multinomial(q, 1, generator=generator)), q


def build_draft(
    spec: SpeculativeConfig,
    target: LlamaForCausalLM,
    target_config: EngineConfig,
    target_kv_cache: torch.Tensor,
) -> DraftModel:
    """The draft model of `spec`, sized to the target's KV pool (same number of blocks)."""
    budget = target_config.max_num_batched_tokens
    if spec.model is None:
        if target_config.quantization is not None:
            raise ValueError(
                "a self-draft (model None) needs an unquantized target: it drafts with an int4 "
                f"copy of the target's weights, and the target is already {target_config.quantization}"
            )
        draft = self_draft(target, spec.quantization or "int4")
        runner = ModelRunner(draft, target_kv_cache, target_config.block_size)
        return DraftModel(
            runner,
            shares_pool=True,
            max_catch_up=budget,
            weights_bytes=draft_weights_bytes(draft, target),
        )
    loaded = load_model(spec.model)
    if loaded.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({loaded.config.vocab_size}) differs from the "
            f"target's ({target.config.vocab_size})"
        )
    num_blocks = target_kv_cache.shape[0]
    kv_dtype = target_config.kv_cache_dtype
    probe = EngineConfig(
        dtype=target_config.dtype, kv_cache_dtype=kv_dtype, block_size=target_config.block_size
    )
    draft_config = EngineConfig(
        dtype=target_config.dtype,
        kv_cache_dtype=kv_dtype,
        quantization=spec.quantization,
        block_size=target_config.block_size,
        max_num_batched_tokens=budget,
        max_model_len=target_config.max_model_len,
        kv_cache_bytes=num_blocks * kv_layout(loaded, probe).block_nbytes,
    )
    model, kv_cache, _layout, report = build_model_and_pool(loaded, draft_config)
    assert kv_cache.shape[0] == num_blocks
    runner = ModelRunner(model, kv_cache, target_config.block_size)
    return DraftModel(
        runner, shares_pool=False, max_catch_up=budget, weights_bytes=report.weights_bytes
    )


def self_draft(target: LlamaForCausalLM, mode: str) -> LlamaForCausalLM:
    """A copy of `target` sharing its tensors, with quantized copies of its projections."""
    shared: dict[int, object] = {id(t): t for t in [*target.parameters(), *target.buffers()]}
    shared[id(target.rope)] = target.rope  # the RoPE tables: plain attributes, shared too
    draft = copy.deepcopy(target, memo=shared)
    quantize(draft, mode, keep_dense=True)  # in place: the model with its layers swapped
    return draft
