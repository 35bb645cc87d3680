"""Tokenyard: serve LLMs the way the large providers do.

The offline API, in the shape vLLM users know::

    from tokenyard import LLM, SamplingParams
    llm = LLM()  # the default model, SmolLM2-135M-Instruct, on the CPU
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenyard.engine.llm import LLM, LoRARequest
    from tokenyard.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Importing torch costs a second; services that never run the engine should not pay it.
    if name == "LLM":
        from tokenyard.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from tokenyard.engine.llm import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from tokenyard.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
