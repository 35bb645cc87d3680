"""The engine as the workers see it: one Protocol, implemented by LLMEngine and FakeEngine.

    engine: Engine = LLMEngine(EngineConfig())   # or FakeEngine() in plumbing tests
    engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():                # list[RequestOutput]
            ...

Outputs are the torch-free types of engine/outputs.py; the hand-off half is
engine/handoff.py; the calls the KV package makes are kv/engine_port.py. All calls must
come from one thread. tests/unit/test_engine_contract.py has mypy check that both
implementations satisfy it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tokenyard.engine.handoff import Handoff
from tokenyard.engine.outputs import AdapterInfo, EngineStats, RequestOutput
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.kv.engine_port import KVEngine

if TYPE_CHECKING:
    import torch

    from tokenyard.kv.layout import KVLayout

# A string, token ids, or chat messages ({"role": ..., "content": ...}).
Prompt = str | list[int] | list[dict]


class Detokenizer(Protocol):
    def decode(self, ids: list[int], /) -> str: ...


class Engine(Handoff, KVEngine, Protocol):
    @property
    def model_id(self) -> str: ...

    @property
    def tokenizer(self) -> Detokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block (what the router hashes prompts by)."""
        ...

    @property
    def layout(self) -> KVLayout | None: ...

    @property
    def kv_cache(self) -> torch.Tensor | None: ...

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, *, prefill_only: bool = False
    ) -> None:
        """Queue a request; ValueError for a bad prompt, RequestIdInUse (a ValueError) for a
        request id already in use."""
        ...

    def step(self) -> list[RequestOutput]: ...

    def add_lora(self, name: str, path: str) -> AdapterInfo:
        """Load a PEFT LoRA adapter; InvalidAdapter (a ValueError) names what is wrong with
        it, AdapterLimit (a ValueError) the limit it is beyond (models/lora_adapter.py)."""
        ...

    def remove_lora(self, name: str) -> bool:
        """Unload it now (True) or once the requests using it end (False); UnknownAdapter."""
        ...

    def list_loras(self) -> list[AdapterInfo]: ...

    @property
    def last_step_tokens(self) -> int:
        """Tokens the last step computed (prefill chunks and decodes): what the worker's
        step timing fits its cost per token on."""
        ...

    @property
    def last_step_batch(self) -> dict[str, int]:
        """The same per request id: what each sequence of the last step computed (the
        worker shares the step's energy by it)."""
        ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when the engine does not know it."""
        ...

    def stats(self) -> EngineStats: ...

    def drain_kv_events(self) -> list[tuple[str, list[int]]]:
        """("stored" | "removed", block hashes) runs since the last call, in order."""
        ...

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (oldest cached first): the state
        those events describe."""
        ...
