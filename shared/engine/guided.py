"""Constrained decoding: a grammar per request decides which tokens may come next.

llguidance does the grammar work (JSON schema, regex, Lark, a choice of strings): it builds
a token trie from the tokenizer once, needs no per-schema compile step, and computes one
request's mask in about ten microseconds on the CPU (docs/structured_outputs.md has the
figures and the comparison with xgrammar).

A step's masks are computed on a worker thread while the model runs its forward pass, and
applied to the logits afterwards, so no request in the batch waits on a grammar:

    pending = guide.begin(completing_seqs)     # before the forward pass: masks start
    logits = pending.apply(logits)             # after it: disallowed tokens get -inf
    guide.advance(seq, token)                  # after sampling: the grammar moves on

The grammar state is rebuilt from the spec and the tokens a sequence already has, so it
survives preemption (the output tokens stay), a prefill-to-decode hand-off and a resume on
another decode worker (both carry the spec and the output tokens: :meth:`Guide.attach`
replays them).

When a guided sequence reaches `max_tokens` before its grammar can end, it does not stop
mid-structure: it goes on in *closing* mode (the most likely allowed token, with tokens that
close strings, arrays and objects preferred) until the grammar accepts, at most
`CLOSE_MAX_TOKENS` more tokens, and finishes with reason "length". The answer then parses
and validates, at the cost of a few tokens past the limit.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from tokenyard.engine.grammar import GuidedError, grammar_for

if TYPE_CHECKING:
    from tokenyard.engine.sequence import Sequence
    from tokenyard.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CLOSE_MAX_TOKENS = 64
# Preference given in closing mode to allowed tokens that only close what is open.
_CLOSER_BONUS = 1e4
_CLOSERS = set('"]}')


class Grammar:
    """One sequence's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.closing = False  # past max_tokens: steer to the nearest end

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            # The mask made this token impossible; a model that still sampled it (a -inf
            # row everywhere) leaves the grammar in error, which `done` reports.
            log.warning("grammar refused token %d: %s", token_id, self.matcher.get_error())

    @property
    def done(self) -> bool:
        """Nothing more may follow: the sequence ends here."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


@dataclass
class MaskStats:
    """What the masks cost: computing them (on the mask thread, beside the forward pass)
    and the main thread's wait for them after the forward pass (the part that adds latency)."""

    num_masks: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0


class Guide:
    """Builds grammars for one tokenizer and computes a step's masks off the main thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guided-mask")
        self._closer_ids: torch.Tensor | None = None
        self.stats = MaskStats()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        # NOTE: built on first use (about a second), so engines that never see a guided
        # request never pay for it.
        if self._ll is None:
            eos = self._tokenizer.eos_token_id
            self._ll = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos
            )
            self._executor = llguidance.LLExecutor(num_threads=1)
        return self._ll

    def attach(self, seq: Sequence) -> None:
        """Give a guided sequence its grammar, replaying the output tokens it already has."""
        spec = seq.params.guided
        if spec is None:
            seq.grammar = None
            return
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_for(spec))
        if matcher.is_error():
            raise GuidedError(f"invalid {spec.kind}: {matcher.get_error()}")
        grammar = Grammar(matcher)
        for token in seq.output_token_ids:
            grammar.advance(token)
        grammar.closing = seq.num_output_tokens >= seq.params.max_tokens
        seq.grammar = grammar

    def begin(self, seqs: list[Sequence]) -> PendingMasks:
        """Start computing the masks of the guided sequences among `seqs`."""
        rows = [(s, s.grammar) for s in seqs if s.grammar is not None]
        if not rows:
            return PendingMasks(None, [], torch.empty(0, 0, dtype=torch.int32), None)
        # bitmask: [guided rows, ceil(vocab / 32)] int32; bit t of row j set = token t allowed
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        assert self._executor is not None  # set with ll_tokenizer, which attach() needed
        jobs = [(g.matcher, j) for j, (_, g) in enumerate(rows)]
        future = self._pool.submit(self._fill, jobs, bitmask)
        closers = self._closers() if any(g.closing for _, g in rows) else None
        return PendingMasks(future, rows, bitmask, closers, self.stats)

    def _fill(self, jobs: list[tuple[llguidance.LLMatcher, int]], bitmask: torch.Tensor) -> None:
        # bitmask: [rows, ceil(vocab / 32)] int32, bit t of row j set = token t allowed
        assert self._executor is not None
        start = time.perf_counter()
        self._executor.unsafe_compute_mask_ptr(
            jobs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )
        self.stats.compute_s += time.perf_counter() - start
        self.stats.num_masks += len(jobs)

    def _closers(self) -> torch.Tensor:
        """[vocab] bool: tokens made only of closing quotes and brackets (and spaces)."""
        if self._closer_ids is None:
            texts = [self._tokenizer.token_text(t) for t in range(self._tokenizer.vocab_size)]
            flags = [bool(t.strip()) and set(t.strip()) <= _CLOSERS for t in texts]
            flags += [False] * (self.vocab_size - len(flags))
            self._closer_ids = torch.tensor(flags[: self.vocab_size], dtype=torch.bool)
        return self._closer_ids

    @staticmethod
    def advance(seq: Sequence, token_id: int) -> None:
        if seq.grammar is not None:
            seq.grammar.advance(token_id)


class PendingMasks:
    """The masks of one step, being computed; `apply` waits for them."""

    def __init__(
        self,
        future: Future[None] | None,
        rows: list[tuple[Sequence, Grammar]],
        bitmask: torch.Tensor,
        closers: torch.Tensor | None,
        stats: MaskStats | None = None,
    ) -> None:
        self._future, self._rows, self._bitmask = future, rows, bitmask
        self._closers, self._stats = closers, stats

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [B, vocab], row i for seqs[i] -> a copy with each guided row's disallowed
        tokens at -inf, and each closing row reduced to its one preferred token."""
        if self._future is None:
            return logits
        start = time.perf_counter()
        self._future.result()
        if self._stats is not None:
            self._stats.wait_s += time.perf_counter() - start
        logits = logits.clone()
        position = {id(s): i for i, s in enumerate(seqs)}
        index = torch.tensor([position[id(s)] for s, _ in self._rows], dtype=torch.long)
        allowed = unpack_bitmask(self._bitmask, logits.shape[-1])  # [guided rows, vocab]
        rows = logits[index].masked_fill(~allowed, float("-inf"))
        for j, (_, grammar) in enumerate(self._rows):
            if grammar.closing:
                rows[j] = _closing_row(rows[j], allowed[j], self._closers)
        logits[index] = rows
        return logits


def _closing_row(
    row: torch.Tensor, allowed: torch.Tensor, closers: torch.Tensor | None
) -> torch.Tensor:
    """Only the token that ends the structure soonest stays possible: a closing quote or
    bracket when one is allowed, else the most likely allowed token."""
    scores = row.clone()
    if closers is not None:
        scores[: closers.shape[0]] += (
            closers & allowed[: closers.shape[0]]
        ).float() * _CLOSER_BONUS
    best = int(scores.argmax())
    out = torch.full_like(row, float("-inf"))
    out[best] = 0.0
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool, True where the token is allowed (bit t of
    a row is token t, least significant bit first)."""
    as_bytes = bitmask.numpy().view(np.uint8)  # little-endian words: byte order = bit order
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits.astype(bool))
