"""`speculative_config`, in the keys vLLM's users write.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    LLM(speculative_config={"method": "draft", "model": None, "quantization": "int4"})

`model: None` drafts with the target's own weights quantized to int4 (self-speculation);
a path drafts with another model that shares the target's tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft")
# Running sequences from which speculation is off for a step. Measured with
# benchmarks/spec_decode.py on a 2-core CPU (bf16 SmolLM2-135M): verifying k drafts runs each
# sequence's rows through the chunked-prefill attention path, which costs more per sequence
# than the batched decode path, and a batch this large already keeps the matmuls busy.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    model: str | None = None  # draft: a .gguf or HF folder; None = the target's own weights
    quantization: str | None = "int4"  # draft: the draft's weights (None = as loaded)
    prompt_lookup_max: int = 4  # ngram: longest suffix matched
    prompt_lookup_min: int = 2  # ngram: shortest suffix matched
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(
                f"draft quantization must be None, 'int8' or 'int4', got {self.quantization!r}"
            )
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a config, a dict, or its JSON text (`tokenyard up --speculative '{...}'`)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict) or "method" not in value:
            raise ValueError('speculative config needs a "method" ("ngram" or "draft")')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        return cls(**value)
