"""LoRA serving cost: a batch mixing 4 adapters against the same batch on the base model.

    python benchmarks/lora.py [--batch 8] [--max-tokens 32] [--rank 16] [--out lora.json]

One engine with LoRA slots for 4 adapters (random PEFT-format adapters of rank --rank on
q/k/v/o and gate/up/down, written to a temporary folder), the default model at the
worker's default precision (int4 on a CPU). Arms, alternated --repeats times, best of each:
  base:    the batch on the base model (the fused CPU decoder path runs: no adapter rows);
  mixed4:  the same batch with its requests spread over the 4 adapters (one pair of
           low-rank matmuls per adapter present, per projection, per step);
  off:     the batch on an engine without LoRA at all (what enable_lora costs when idle).
Decode tok/s counts output tokens after each request's first over the time after it; ITL
is the mean gap between a request's tokens after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from result_path import OUT_HELP, out_path
from safetensors.torch import save_file

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.config import ModelConfig
from tokenyard.models.loader import load_model
from tokenyard.models.lora_adapter import TARGETS, module_shape

PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Give three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle gear works.",
]


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> str:
    folder.mkdir(parents=True)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": [*TARGETS]}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGETS:
            i, o = module_shape(config, module)
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, i, generator=gen) / i**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=gen) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return str(folder)


def run_batch(engine: LLMEngine, loras: list[str], max_tokens: int) -> dict[str, float]:
    """The batch to its end: decode tok/s after each request's first token, and mean ITL."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    for i, lora in enumerate(loras):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora=lora)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", PROMPTS[i % len(PROMPTS)], params)
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    decode_tokens = sum(n - 1 for n in counts.values())
    span = max(last.values()) - min(first.values())
    gaps = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    return {
        "decode_tok_s": decode_tokens / span if span else 0.0,
        "itl_ms": 1e3 * sum(gaps) / len(gaps) if gaps else 0.0,
    }


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return max(runs, key=lambda r: r["decode_tok_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args()
    loaded = load_model()
    common: dict[str, Any] = {"kv_cache_bytes": 256 * 2**20, "num_threads": args.threads}
    common["quantization"] = "int4"
    with_lora = LLMEngine(
        EngineConfig(enable_lora=True, max_loras=4, max_lora_rank=args.rank, **common),
        loaded=loaded,
    )
    without = LLMEngine(EngineConfig(**common), loaded=loaded)
    names = [f"a{i}" for i in range(4)]
    with tempfile.TemporaryDirectory() as tmp:
        for seed, name in enumerate(names):
            path = write_adapter(Path(tmp) / name, loaded.config, args.rank, seed)
            with_lora.add_lora(name, path)
    runs: dict[str, list[dict[str, float]]] = {"base": [], "mixed4": [], "off": []}
    mixed = [names[i % 4] for i in range(args.batch)]
    run_batch(with_lora, mixed, 4)  # warm-up: every slot loaded, kernels built
    for _ in range(args.repeats):
        runs["base"].append(run_batch(with_lora, [""] * args.batch, args.max_tokens))
        runs["mixed4"].append(run_batch(with_lora, mixed, args.max_tokens))
        runs["off"].append(run_batch(without, [""] * args.batch, args.max_tokens))
    result: dict[str, Any] = {
        "conditions": {
            "model": loaded.model_id,
            "quantization": "int4",
            "batch": args.batch,
            "max_tokens": args.max_tokens,
            "rank": args.rank,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        },
        "best": {arm: best(r) for arm, r in runs.items()},
        "runs": runs,
    }
    b, m = result["best"]["base"], result["best"]["mixed4"]
    result["mixed4_vs_base"] = m["decode_tok_s"] / b["decode_tok_s"] if b["decode_tok_s"] else 0.0
    written = out_path(args.out, "lora")
    written.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["best"], indent=2))
    print(f"mixed4 / base decode tok/s: {result['mixed4_vs_base']:.3f}; written to {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
