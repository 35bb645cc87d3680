"""The step-level engine the workers drive: add requests, run steps, read new tokens, abort.

    engine = LLMEngine(EngineConfig())
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.new_text, out.finish_reason)

It implements tokenyard.engine.contract.Engine; all calls must come from one thread.
"""

from __future__ import annotations

import gc
import itertools
import logging
from typing import Any, cast

import torch

from tokenyard.engine.block_manager import BlockManager
from tokenyard.engine.config import EngineConfig
from tokenyard.engine.contract import Prompt
from tokenyard.engine.expert_balance import ExpertBalancer
from tokenyard.engine.guided import CLOSE_MAX_TOKENS, Guide, PendingMasks
from tokenyard.engine.handoff import SequenceHandoff
from tokenyard.engine.kv_blocks import KVBlocks
from tokenyard.engine.logits_processors import apply_processors
from tokenyard.engine.lora import LoRAManager, UnknownAdapter
from tokenyard.engine.memory import build_model_and_pool
from tokenyard.engine.model_runner import StepLogits
from tokenyard.engine.outputs import (
    AdapterInfo,
    EngineStats,
    ExportedSequence,
    NoFreeBlocks,
    RequestIdInUse,
    RequestOutput,
    TokenLogprob,
)
from tokenyard.engine.parallel import TensorParallelRanks
from tokenyard.engine.pipeline import make_runner
from tokenyard.engine.pooling import add_rows, embedding
from tokenyard.engine.sampler import chosen_logprobs, sample
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.engine.scheduler import ScheduledSeq, Scheduler
from tokenyard.engine.sequence import Sequence, Status
from tokenyard.engine.spec.speculator import build_speculator
from tokenyard.engine.stop import StopChecker
from tokenyard.kv import engine_port
from tokenyard.kv.hashing import prefix_block_hashes, salted_root
from tokenyard.kv.layout import KVLayout
from tokenyard.lifecycle import trim_heap
from tokenyard.models.expert_parallel import check_ep
from tokenyard.models.llama import LlamaForCausalLM
from tokenyard.models.loader import LoadedModel, load_model
from tokenyard.models.lora import apply_lora
from tokenyard.models.moe import moe_blocks
from tokenyard.models.pp import check_pp
from tokenyard.models.tokenizer import IncrementalDetokenizer
from tokenyard.models.tp import check_tp

log = logging.getLogger(__name__)

__all__ = [
    "EngineStats",
    "ExportedSequence",
    "LLMEngine",
    "NoFreeBlocks",
    "RequestOutput",
    "TokenLogprob",
]


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None
    ) -> None:
        """`loaded` reuses weights already read from disk (tests build several engines)."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = loaded or load_model(config.model)
        self.model_id = loaded.model_id
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.ranks = _start_ranks(config, loaded)
        try:
            model, kv_cache, layout, self.memory = build_model_and_pool(loaded, config)
        except BaseException:
            if self.ranks is not None:
                self.ranks.abort()
            raise
        # Blocks cross the engine's boundary whole-head (read_kv_blocks / write_kv_blocks);
        # a tensor-parallel engine's own pool holds only rank 0's heads, so it offers none
        # to be copied from or into directly.
        self.kv_blocks = KVBlocks(kv_cache, layout, self.ranks)
        self.kv_cache: torch.Tensor | None = kv_cache if self.ranks is None else None
        # NOTE: only an engine whose ranks split the heads offers KV to hand-offs and the
        # KV-cache service (KVBlocks joins heads): not one in pipeline stages (its ranks
        # hold layers), nor expert-parallel ranks of whole attention (tp 1, each a full pool).
        heads_split = config.world_size == config.tensor_parallel_size
        self.layout: KVLayout | None = self.kv_blocks.layout if heads_split else None
        self.lora = _lora_manager(model, config)
        num_blocks = kv_cache.shape[0]
        self.block_size = config.block_size
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            num_blocks * config.block_size,
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            grow_for_cache=config.prefix_cache_grows_pool,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            lora=self.lora,
        )
        self.runner = make_runner(
            config,
            model,
            kv_cache,
            broadcast=self.ranks.broadcast if self.ranks else None,
            lora=self.lora,
        )
        self.expert_balancer = _expert_balancer(config, model, self.ranks)
        self.guide = Guide(self.tokenizer, self.model_config.vocab_size)
        self.speculator = build_speculator(
            config, self.runner, self.block_manager, self.max_model_len
        )
        if self.speculator is not None and self.speculator.draft is not None:
            draft = self.speculator.draft
            self.memory.draft_weights_bytes = draft.weights_bytes
            self.memory.draft_kv_cache_bytes = draft.kv_cache_bytes
        self.seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.handoff = SequenceHandoff(
            self.seqs,
            self._arrivals,
            self.block_manager,
            self.scheduler,
            self.guide,
            attach_output_state=self._attach_output_state,
            check_length=self._check_length,
            vocab_size=self.model_config.vocab_size,
        )
        self.last_step_tokens = 0  # tokens the last step computed (prefill chunks + decodes)
        self.last_step_batch: dict[str, int] = {}  # the same, per request
        del loaded
        gc.collect()  # the loaded checkpoint and the model's intermediate copies
        trim_heap()
        log.info("engine ready: %s; memory: %s", self.model_id, self.memory.describe())

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine takes no steps after)."""
        if self.ranks is not None:
            self.ranks.close()

    # --- requests ------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("the prompt is empty")
        if all(isinstance(m, dict) for m in prompt):
            messages = cast("list[dict[str, Any]]", prompt)
            return self.tokenizer.encode(
                self.tokenizer.apply_chat_template(messages), add_special_tokens=False
            )
        ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
        if len(ids) == len(prompt):
            vocab = self.model_config.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"token ids must be in [0, {vocab})")
            return ids
        raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages")

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, *, prefill_only: bool = False
    ) -> None:
        if request_id in self.seqs:
            raise RequestIdInUse(request_id)
        if prefill_only and params.pooling:
            raise ValueError("a pooling request runs whole on one worker: not prefill_only")
        self.check_adapter(params.lora)
        prompt_ids = self.encode_prompt(prompt)
        self._check_length(len(prompt_ids))
        seq = Sequence(
            request_id, prompt_ids, params, arrival=next(self._arrivals), prefill_only=prefill_only
        )
        self._attach_output_state(seq)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def check_adapter(self, name: str) -> None:
        """Raise UnknownAdapter unless a request may run on LoRA adapter `name` ('' = base)."""
        if not name:
            return
        if self.lora is None:
            raise UnknownAdapter(name, " (this engine serves no LoRA adapters: enable_lora)")
        self.lora.check(name)

    # --- LoRA adapters (engine/lora.py) ----------------------------------------------------

    def add_lora(self, name: str, path: str) -> AdapterInfo:
        """Load the PEFT adapter in folder `path` as `name`; InvalidAdapter or AdapterLimit
        (models/lora_adapter.py) say what is wrong."""
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with enable_lora)")
        self.lora.load(name, path)
        return next(a for a in self.lora.info() if a.name == name)

    def remove_lora(self, name: str) -> bool:
        """Unload `name`: at once (True) or, while requests still use it, once they end
        (False; new requests are refused meanwhile)."""
        if self.lora is None:
            raise UnknownAdapter(name)
        return self.lora.unload(name, in_use=name in self._adapters_in_use())

    def list_loras(self) -> list[AdapterInfo]:
        return self.lora.info() if self.lora is not None else []

    def _adapters_in_use(self) -> set[str]:
        return {s.params.lora for s in self.seqs.values() if s.params.lora}

    def _check_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt_tokens} tokens; this model accepts at most "
                f"{self.max_model_len - 1} prompt tokens (max_model_len {self.max_model_len})"
            )

    def _attach_output_state(self, seq: Sequence) -> None:
        """Detokenizer, stop checker and grammar, caught up with the output tokens it has."""
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids)
        seq.stop_checker = StopChecker(seq.params.stop, seq.params.include_stop_str_in_output)
        self.guide.attach(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status == Status.HELD or seq.status == Status.IMPORTING:
            self.block_manager.free_sequence(seq)
            seq.status = Status.FINISHED
        else:
            self.scheduler.finish(seq, "abort")
        self._finish_unloads()
        return True

    def abort_if_waiting(self, request_id: str) -> bool:
        """Abort a request that has not begun: queued, nothing of it computed or sent (a
        stopping worker hands such requests back at once); False for any other."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status != Status.WAITING:
            return False
        if seq.num_computed_tokens or seq.num_output_tokens:
            return False  # preempted after it began: it has sent tokens, it ends here
        return self.abort(request_id)

    def _finish_unloads(self) -> None:
        if self.lora is not None and self.lora.unloading:
            self.lora.finish_unloads(self._adapters_in_use())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        stats = EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            prefix_cache_hits=bm.stats.hits,
            prefix_cache_queries=bm.stats.queries,
            num_preemptions=self.scheduler.num_preemptions,
            expert_tokens=[b.tokens_per_expert.tolist() for b in moe_blocks(self.runner.model)],
            num_pending_prompt_tokens=self.scheduler.pending_prompt_tokens(),
            tenants=self.scheduler.tenant_stats(),
        )
        if self.expert_balancer is not None:
            stats.expert_balance = self.expert_balancer.stats()
        if self.lora is not None:
            served = [a for a in self.lora.info() if not a.unloading]
            stats.loras = {a.name: a.num_running for a in served}
            stats.lora_paths = {a.name: a.path for a in served}
            stats.lora_room = self.lora.room()
            stats.lora_swaps = self.lora.num_swaps
        if self.speculator is not None:
            spec = self.speculator.stats
            stats.spec_num_drafts = spec.num_drafts
            stats.spec_draft_tokens = spec.num_draft_tokens
            stats.spec_accepted_tokens = spec.num_accepted_tokens
            stats.spec_acceptance_rate = spec.acceptance_rate
            stats.spec_mean_accepted_length = spec.mean_accepted_length
        return stats

    def drain_kv_events(self) -> list[tuple[str, list[int]]]:
        """KV block events since the last call, grouped into runs of the same kind."""
        grouped: list[tuple[str, list[int]]] = []
        for kind, h in self.block_manager.drain_events():
            if grouped and grouped[-1][0] == kind:
                grouped[-1][1].append(h)
            else:
                grouped.append((kind, [h]))
        return grouped

    def cached_block_hashes(self) -> list[int]:
        return list(self.block_manager.cached)

    # --- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.last_step_batch = {s.seq.request_id: s.num_tokens for s in batch}
        self.last_step_tokens = sum(self.last_step_batch.values())
        if not batch:
            return []
        # Grammar masks are computed on another thread while the model runs.
        masks = self.guide.begin([s.seq for s in batch if s.completes and not s.seq.params.pooling])
        result = self.runner.run(batch)
        for s in batch:
            s.seq.num_computed_tokens += s.num_tokens
            self.block_manager.register_computed(s.seq)
        self._record_prompt_logprobs(result)
        outputs = self._sample(result, masks) if result.completing else []
        outputs += self._pool(result)
        if self.speculator is not None:
            # NOTE: drafts skip the grammar and the logit edits, so those requests get none.
            self.speculator.propose([s for s in self.scheduler.running if not _processed(s)])
        self._finish_unloads()
        if self.expert_balancer is not None:  # between steps: every rank is idle
            self.expert_balancer.after_step()
        return outputs

    def _pool(self, result: StepLogits) -> list[RequestOutput]:
        """Pooling requests: fold in this step's rows; end those whose prompt is computed."""
        outputs = []
        for s, hidden in result.pooled:
            seq = s.seq
            add_rows(seq, hidden, seq.num_computed_tokens - s.num_tokens)
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                continue
            vector = embedding(seq)
            self._finish(seq, "stop")
            outputs.append(
                RequestOutput(
                    request_id=seq.request_id,
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason="stop",
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_output_tokens=0,
                    num_cached_tokens=seq.num_cached_tokens,
                    embedding=vector,
                )
            )
        return outputs

    def _sample(self, result: StepLogits, masks: PendingMasks) -> list[RequestOutput]:
        seqs = [s.seq for s in result.completing]
        plain = [i for i, s in enumerate(result.completing) if not s.spec_token_ids]
        if len(plain) == len(seqs):
            tokens, logprobs = self._sample_rows(result.logits, seqs, masks)
            return [
                self._append_token(seq, t, lp)
                for seq, t, lp in zip(seqs, tokens, logprobs, strict=True)
            ]
        emitted: list[tuple[list[int], list[TokenLogprob | None]]] = [([], [])] * len(seqs)
        if plain:
            rows = [seqs[i] for i in plain]
            tokens, logprobs = self._sample_rows(result.logits[plain], rows, masks)
            for i, t, lp in zip(plain, tokens, logprobs, strict=True):
                emitted[i] = ([t], [lp])
        assert self.speculator is not None
        for i, s in enumerate(result.completing):
            if s.spec_token_ids:
                emitted[i] = self.speculator.verify(s, result.logits[i], result.spec_logits[i])
        return [
            self._append_tokens(s, tokens, logprobs)
            for s, (tokens, logprobs) in zip(result.completing, emitted, strict=True)
        ]

    def _sample_rows(
        self, raw: torch.Tensor, seqs: list[Sequence], masks: PendingMasks
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row: grammar masks and logit edits first, then the sampler."""
        logits = masks.apply(raw, seqs)
        logits = apply_processors(logits, seqs, self.tokenizer.eos_token_ids)
        tokens, logprobs = sample(logits, seqs)
        if logits is not raw:  # logprobs come from the model's own distribution
            logprobs = chosen_logprobs(raw, tokens, [s.params.logprobs for s in seqs])
        return tokens, logprobs

    def _append_tokens(
        self, s: ScheduledSeq, tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> RequestOutput:
        """Append a verified run of tokens (up to the first that finishes the sequence); the
        K/V of every token but the newest is then computed, and slots past it rolled back."""
        seq = s.seq
        outs = []
        for t, lp in zip(tokens, logprobs, strict=True):
            outs.append(self._append_token(seq, t, lp))
            if outs[-1].finished:
                break
        if s.spec_token_ids and seq.status == Status.RUNNING:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.register_computed(seq)
            self.block_manager.trim(seq)
        return _merge(outs)

    def _append_token(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        seq.token_ids.append(token_id)
        self.guide.advance(seq, token_id)
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = self._finish_reason(seq, token_id)
        assert seq.detokenizer is not None and seq.stop_checker is not None
        delta = seq.detokenizer.push([token_id])
        if reason is not None:
            delta += seq.detokenizer.flush()
        text, stopped = seq.stop_checker.feed(delta, final=reason is not None)
        if stopped:
            reason = "stop"
        seq.text += text
        if reason is not None:
            self._finish(seq, reason)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token_id],
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=[logprob] if logprob is not None else None,
        )

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
        if seq.grammar is not None:
            return self._guided_finish_reason(seq, token_id)
        if token_id in p.stop_token_ids:
            return "stop"
        if not p.ignore_eos and token_id in self.tokenizer.eos_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        if seq.prefill_only:
            return "prefilled"
        return None

    def _guided_finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        """A guided sequence ends when its grammar does; past max_tokens it closes what is
        open first (guided.py), so its output still parses."""
        grammar, p = seq.grammar, seq.params
        assert grammar is not None
        if grammar.closing and grammar.accepting:
            return "length"
        if grammar.done or token_id in self.tokenizer.eos_token_ids:
            return "stop"
        if token_id in p.stop_token_ids and grammar.accepting:
            return "stop"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        if seq.num_output_tokens >= p.max_tokens:
            if grammar.accepting or seq.num_output_tokens >= p.max_tokens + CLOSE_MAX_TOKENS:
                return "length"
            grammar.closing = True
        if seq.prefill_only:
            return "prefilled"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        if reason == "prefilled":  # blocks stay until release()
            self.scheduler.finish(seq, reason, keep_blocks=True)
            return
        self.scheduler.finish(seq, reason)
        del self.seqs[seq.request_id]

    def _record_prompt_logprobs(self, result: StepLogits) -> None:
        for s, first, logits in result.prompt_rows:
            seq = s.seq
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context
            # Row r predicts the token at position first + r + 1.
            n = min(len(logits), seq.num_prompt_tokens - 1 - first)
            targets = seq.token_ids[first + 1 : first + 1 + n]
            seq.prompt_logprobs.extend(
                chosen_logprobs(logits[:n], targets, [seq.params.prompt_logprobs] * n)
            )

    # --- the hand-off (tokenyard.engine.handoff) -------------------------------------------

    def export_sequence(self, request_id: str) -> ExportedSequence:
        return self.handoff.export_sequence(request_id)

    def release(self, request_id: str) -> None:
        self.handoff.release(request_id)

    def import_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
    ) -> list[int]:
        self.check_adapter(params.lora)
        return self.handoff.import_sequence(request_id, prompt_token_ids, output_token_ids, params)

    def commit_import(self, request_id: str, kv_ok: bool) -> None:
        self.handoff.commit_import(request_id, kv_ok)

    # --- the KV-cache service's calls (tokenyard.kv.engine_port) ---------------------------

    def cached_block_ids(self, hashes: list[int]) -> list[tuple[int, int]]:
        return engine_port.cached_block_ids(self.block_manager.cached, hashes)

    def num_cached_prefix_blocks(self, hashes: list[int]) -> int:
        return engine_port.num_cached_prefix_blocks(self.block_manager.cached, hashes)

    def reserve_prefix(
        self, request_id: str, token_ids: list[int], cache_salt: str = ""
    ) -> list[int]:
        return self.handoff.reserve_prefix(request_id, token_ids, cache_salt)

    def commit_prefix(self, request_id: str, kv_ok: bool) -> None:
        self.handoff.commit_prefix(request_id, kv_ok)

    def land_prefix(
        self, token_ids: list[int], cache_salt: str, blocks: torch.Tensor, first: int
    ) -> int:
        bs = self.block_manager.block_size
        n = len(token_ids) // bs
        hashes = prefix_block_hashes(token_ids[: n * bs], bs, salted_root(cache_salt))
        tokens = [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(n)]

        def write(block_ids: list[int], offset: int) -> None:
            self.kv_blocks.write(block_ids, blocks[offset : offset + len(block_ids)])

        return self.block_manager.land_prefix(hashes, tokens, first, write) * bs

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.kv_blocks.read(block_ids)

    def write_kv_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        self.kv_blocks.write(block_ids, blocks)


def _lora_manager(model: LlamaForCausalLM, config: EngineConfig) -> LoRAManager | None:
    """The model's LoRA slots and their manager where the engine serves adapters."""
    if not config.enable_lora:
        return None
    layers = apply_lora(model, config.max_loras, config.max_lora_rank)
    assert model.lora_batch is not None  # apply_lora set it
    return LoRAManager(
        layers,
        model.lora_batch,
        model.config,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
    )


def _start_ranks(config: EngineConfig, loaded: LoadedModel) -> TensorParallelRanks | None:
    """The other tensor-, pipeline- and expert-parallel ranks, started and joined; None on
    one rank."""
    if config.world_size == 1:
        return None
    check_tp(loaded.config, config.tensor_parallel_size)  # before starting any process
    check_pp(loaded.config, config.pipeline_parallel_size)
    check_ep(loaded.config, config.expert_parallel_size)
    return TensorParallelRanks(config, loaded.path)


def _expert_balancer(
    config: EngineConfig, model: LlamaForCausalLM, ranks: TensorParallelRanks | None
) -> ExpertBalancer | None:
    """Expert parallelism's placement balancer on rank 0; None on one expert-parallel rank."""
    if config.expert_parallel_size == 1:
        return None
    assert ranks is not None
    return ExpertBalancer(model, config.expert_rebalance_interval, ranks.broadcast)


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """One output for several tokens of one sequence in one step."""
    last = outs[-1]
    if len(outs) == 1:
        return last
    logprobs = [lp for o in outs for lp in (o.logprobs or [])]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outs),
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=last.num_cached_tokens,
        logprobs=logprobs or None,
    )


def _processed(seq: Sequence) -> bool:
    """A request whose logits are edited before sampling (a grammar, logit_bias, min_tokens)."""
    p = seq.params
    # A pooling request is not processed, but it never decodes: no drafts either.
    return seq.grammar is not None or bool(p.logit_bias) or p.min_tokens > 0 or bool(p.pooling)
