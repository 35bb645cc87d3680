"""The offline API, in the shape vLLM's users know.

from tokenyard import LLM, SamplingParams
llm = LLM()
for out in llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16)):
    print(out.text)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.contract import Prompt
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.outputs import TokenLogprob
from tokenyard.engine.sampling_params import SamplingParams


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for `LLM.generate`, in vLLM's shape: a name, a number (unused here
    beyond vLLM's signature: names identify adapters), and the PEFT folder to load it from."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (a no-op on one rank)."""
        self.engine.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion with continuous batching; results in input order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt; each is
        loaded the first time it is named (the engine needs enable_lora=True)."""
        prompts = _as_prompt_list(prompts)
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("give one LoRARequest, or one (or None) per prompt")
        plist = [self._on_adapter(p, lora) for p, lora in zip(plist, loras, strict=True)]
        ids = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, prompt, p)  # bad input raises here, before any work
            ids.append(rid)
        seqs = {rid: self.engine.seqs[rid] for rid in ids}
        while self.engine.has_unfinished():
            self.engine.step()
        return [_result(seqs[rid]) for rid in ids]

    def _on_adapter(self, params: SamplingParams, lora: LoRARequest | None) -> SamplingParams:
        if lora is None:
            return params
        if all(a.name != lora.lora_name for a in self.engine.list_loras()):
            self.engine.add_lora(lora.lora_name, lora.lora_path)
        return dataclasses.replace(params, lora=lora.lora_name)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        params: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(cast("list[Prompt]", list(conversations)), params)


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [cast(Prompt, prompts)]  # one prompt of token ids
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [cast(Prompt, prompts)]  # one conversation
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("no prompts given")
    return cast("list[Prompt]", prompts)


def _result(seq: Any) -> GenerationResult:
    return GenerationResult(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=seq.output_token_ids,
        text=seq.text,
        finish_reason=seq.finish_reason,
        num_cached_tokens=seq.num_cached_tokens,
        logprobs=seq.logprobs if seq.params.logprobs is not None else None,
        prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
    )
