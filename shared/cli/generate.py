"""`tokenyard generate`: offline generation, or an interactive chat when no prompt is given."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenyard.engine.llm_engine import LLMEngine
    from tokenyard.engine.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="*", help="a user message; none = interactive chat")
    parser.add_argument(
        "--model",
        default=None,
        help="a .gguf file or an HF folder (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "fp8"],
        help="weight-only quantization (int4 is the default model's own Q4_1 precision)",
    )
    parser.add_argument(
        "--speculative",
        metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def run(args: argparse.Namespace) -> int:
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine
    from tokenyard.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            speculative_config=args.speculative,
        )
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    print(f"{engine.model_id}: {engine.memory.describe()}", file=sys.stderr)
    if args.prompt:
        _reply(engine, [{"role": "user", "content": " ".join(args.prompt)}], params)
        return 0
    history: list[dict] = []
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        history.append({"role": "user", "content": line})
        history.append({"role": "assistant", "content": _reply(engine, history, params)})


def _reply(engine: LLMEngine, messages: list[dict], params: SamplingParams) -> str:
    rid = f"cli-{len(messages)}"
    engine.add_request(rid, messages, params)
    text = []
    while engine.has_unfinished():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            text.append(out.new_text)
    print()
    return "".join(text)
