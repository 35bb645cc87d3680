"""A test double of the engine: the same methods, no model, deterministic tokens.

It lets the service plumbing (queues, hand-offs, cancel, redelivery) be tested in seconds.
It implements tokenyard.engine.contract.Engine and answers with the engine's own output
types, so a drift between the two is a type error, not a surprise in production.
Token t+1 is a fixed function of token t, so a request continued on another worker yields
the same tokens, like the real engine's greedy or seeded sampling.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engine.outputs import (
    AdapterInfo,
    EngineStats,
    ExportedSequence,
    NoFreeBlocks,
    RequestIdInUse,
    RequestOutput,
    UnknownAdapter,
)
from tokenyard.engine.sampling_params import SamplingParams

VOCAB = 1000
EOS = 0
HIDDEN_SIZE = 8  # the length of a pooling request's vector


def next_token(last: int) -> int:
    return (last * 31 + 7) % (VOCAB - 1) + 1  # never EOS


def fake_embedding(prompt: list[int], pooling: str) -> list[float]:
    """A unit vector that is a fixed function of the prompt (of its last token for "last")."""
    tokens = prompt[-1:] if pooling == "last" else prompt
    vector = [float(sum((t * (k + 3)) % 17 - 8 for t in tokens)) for k in range(HIDDEN_SIZE)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class FakeTokenizer:
    eos_token_ids = {EOS}

    def encode(self, text: str) -> list[int]:
        return [(ord(c) % (VOCAB - 1)) + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + (
            "assistant: " if add_generation_prompt else ""
        )


@dataclass
class _Seq:
    prompt: list[int]
    params: SamplingParams
    prefill_only: bool
    blocks: list[int]
    output: list[int] = field(default_factory=list)
    committed: bool = True
    held: bool = False


class FakeEngine:
    def __init__(
        self,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_model_len: int = 2048,
        step_s: float = 0.005,
    ) -> None:
        self.model_id = "fake-model"
        self.tokenizer = FakeTokenizer()
        self.layout = None  # no KV pool: decode workers recompute handed-off prompts
        self.kv_cache = None
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.step_s = step_s
        self._free = list(range(num_blocks))
        self._seqs: dict[str, _Seq] = {}
        self.last_step_tokens = 0  # one per sequence stepped: the fake decodes only
        self.last_step_batch: dict[str, int] = {}

    def _check_new(self, request_id: str) -> None:
        # As the real engine: one sequence per request id.
        if request_id in self._seqs:
            raise RequestIdInUse(request_id)

    def _allocate(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // self.block_size)
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks, self._free = self._free[:n], self._free[n:]
        return blocks

    def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, *, prefill_only: bool = False
    ) -> None:
        self._check_new(request_id)
        if params.lora:
            raise UnknownAdapter(params.lora, " (the fake engine serves no LoRA adapters)")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens exceeds max_model_len {self.max_model_len}"
            )
        self._seqs[request_id] = _Seq(
            ids, params, prefill_only, self._allocate(len(ids) + params.max_tokens)
        )

    def _active(self) -> list[tuple[str, _Seq]]:
        return [(r, s) for r, s in self._seqs.items() if s.committed and not s.held][
            : self.max_num_seqs
        ]

    def has_unfinished(self) -> bool:
        return bool(self._active())

    def step(self) -> list[RequestOutput]:
        active = self._active()
        self.last_step_tokens = len(active)
        self.last_step_batch = {rid: 1 for rid, _ in active}
        if active and self.step_s:
            time.sleep(self.step_s)
        return [self._advance(rid, seq) for rid, seq in active]

    def _advance(self, rid: str, seq: _Seq) -> RequestOutput:
        if seq.params.pooling:
            return self._pool(rid, seq)
        tok = next_token(seq.output[-1] if seq.output else seq.prompt[-1])
        seq.output.append(tok)
        reason = None
        if len(seq.output) >= seq.params.max_tokens:
            reason = "length"
        elif seq.prefill_only:
            reason = "prefilled"
        if reason == "prefilled":
            seq.held = True
        elif reason is not None:
            self._free_seq(rid)
        return RequestOutput(
            request_id=rid,
            new_token_ids=[tok],
            new_text=self.tokenizer.decode([tok]),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt),
            num_output_tokens=len(seq.output),
            num_cached_tokens=0,
        )

    def _pool(self, rid: str, seq: _Seq) -> RequestOutput:
        """A pooling request ends in one step, with its vector and no token."""
        self._free_seq(rid)
        return RequestOutput(
            request_id=rid,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="stop",
            num_prompt_tokens=len(seq.prompt),
            num_output_tokens=0,
            num_cached_tokens=0,
            embedding=fake_embedding(seq.prompt, seq.params.pooling or "mean"),
        )

    def _free_seq(self, rid: str) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self._free.extend(seq.blocks)

    def add_lora(self, name: str, path: str) -> AdapterInfo:
        raise ValueError("the fake engine serves no LoRA adapters")

    def remove_lora(self, name: str) -> bool:
        raise UnknownAdapter(name)

    def list_loras(self) -> list[AdapterInfo]:
        return []

    def abort(self, request_id: str) -> bool:
        found = request_id in self._seqs
        self._free_seq(request_id)
        return found

    def export_sequence(self, request_id: str) -> ExportedSequence:
        seq = self._seqs[request_id]
        return ExportedSequence(
            request_id=request_id,
            prompt_token_ids=seq.prompt,
            output_token_ids=list(seq.output),
            block_ids=seq.blocks[: -(-len(seq.prompt) // self.block_size)],
            num_computed_tokens=len(seq.prompt),
            params=seq.params,
        )

    def release(self, request_id: str) -> None:
        self._free_seq(request_id)

    def import_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
    ) -> list[int]:
        self._check_new(request_id)
        if not prompt_token_ids or not output_token_ids:  # as the real engine
            raise ValueError("an imported sequence needs its prompt and at least its first token")
        blocks = self._allocate(len(prompt_token_ids) + params.max_tokens)
        seq = _Seq(
            list(prompt_token_ids), params, False, blocks, list(output_token_ids), committed=False
        )
        self._seqs[request_id] = seq
        return blocks[: -(-len(prompt_token_ids) // self.block_size)]

    def commit_import(self, request_id: str, kv_ok: bool) -> None:
        self._seqs[request_id].committed = True

    def stats(self) -> EngineStats:
        active = self._active()
        waiting = sum(1 for s in self._seqs.values() if s.committed and not s.held) - len(active)
        return EngineStats(
            num_running=len(active),
            num_waiting=waiting,
            num_free_blocks=len(self._free),
            num_blocks=self.num_blocks,
            prefix_cache_hits=0,
            prefix_cache_queries=0,
            num_preemptions=0,  # it never runs out of blocks mid-request
        )

    def drain_kv_events(self) -> list[tuple[str, list[int]]]:
        return []  # no prefix cache, so nothing is ever stored or removed

    def cached_block_hashes(self) -> list[int]:
        return []

    # --- kv.engine_port: no prefix cache, so nothing is ever found or kept ------------------

    def cached_block_ids(self, hashes: list[int]) -> list[tuple[int, int]]:
        return []

    def num_cached_prefix_blocks(self, hashes: list[int]) -> int:
        return 0

    def reserve_prefix(
        self, request_id: str, token_ids: list[int], cache_salt: str = ""
    ) -> list[int]:
        self._check_new(request_id)
        blocks = self._allocate(len(token_ids))
        params = SamplingParams(max_tokens=1, cache_salt=cache_salt)
        self._seqs[request_id] = _Seq(list(token_ids), params, False, blocks, committed=False)
        return blocks

    def commit_prefix(self, request_id: str, kv_ok: bool) -> None:
        self._free.extend(self._seqs.pop(request_id).blocks)

    def land_prefix(self, token_ids: list[int], cache_salt: str, blocks: Any, first: int) -> int:
        return 0

    def read_kv_blocks(self, block_ids: list[int]) -> Any:
        raise ValueError("the fake engine has no KV pool to read blocks from")

    def write_kv_blocks(self, block_ids: list[int], blocks: Any) -> None:
        raise ValueError("the fake engine has no KV pool to write blocks into")
