"""LoRA serving cost: a batch mixing 4 adapters against the same batch on the base model.

    python benchmarks/lora.py [--batch 8] [--max-tokens 32] [--rank 16] [--out lora.json]

One engine with LoRA slots for 4 adapters (random PEFT-format adapters of rank --rank on
q/k/v/o and gate/up/down, written to a temporary folder), the default model at the
worker's default precision (int4 on a CPU). Arms, alternated --repeats times, best of each:
  base:    the batch on the base model (the fused CPU decoder path runs: no adapter rows);
  mixed4:  the same batch with its requests spread over the 4 adapters (one pair of
           low-rank matmuls per adapter present, per projection, per step);
  off:     the batch on an engine without LoRA at all (what enable_lora costs when idle).
Output tok/s counts every output token over the batch's wall time (prefill included);
decode tok/s the tokens after each request's first over the time after it. ITL p50/p99 are
over every gap between two successive tokens of a request. Progress goes to stdout.
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
from tokenyard.stats import percentile

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
    """The batch to its end: output and decode tok/s, and ITL p50/p99 over every gap."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    gaps: list[float] = []
    start = time.perf_counter()
    for i, lora in enumerate(loras):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora=lora)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", PROMPTS[i % len(PROMPTS)], params)
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id in last and out.new_token_ids:
                gaps.append((now - last[out.request_id]) / len(out.new_token_ids))
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    end = max(last.values())
    decode_span = end - min(first.values())
    return {
        "output_tok_s": sum(counts.values()) / (end - start),
        "decode_tok_s": sum(n - 1 for n in counts.values()) / decode_span if decode_span else 0.0,
        "itl_p50_ms": 1e3 * percentile(gaps, 50) if gaps else 0.0,
        "itl_p99_ms": 1e3 * percentile(gaps, 99) if gaps else 0.0,
    }


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    return max(runs, key=lambda r: r["output_tok_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", help=OUT_HELP)
    parser.add_argument(
        "--adapters-dir",
        type=Path,
        help="write the adapters here and keep them (default: a "
        "temporary folder, removed at the end); benchmarks/lora_serve.py serves them",
    )
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
        folder = args.adapters_dir or Path(tmp)
        for seed, name in enumerate(names):
            path = write_adapter(folder / name, loaded.config, args.rank, seed)
            with_lora.add_lora(name, path)
    runs: dict[str, list[dict[str, float]]] = {"base": [], "mixed4": [], "off": []}
    mixed = [names[i % 4] for i in range(args.batch)]
    print("adapters loaded; warming up", flush=True)
    run_batch(with_lora, mixed, 4)  # warm-up: every slot loaded, kernels built
    batches = {"base": (with_lora, [""] * args.batch), "mixed4": (with_lora, mixed)}
    batches["off"] = (without, [""] * args.batch)
    for repeat in range(args.repeats):
        for arm, (engine, loras) in batches.items():
            r = run_batch(engine, loras, args.max_tokens)
            runs[arm].append(r)
            print(
                f"[{repeat + 1}/{args.repeats}] {arm}: {r['output_tok_s']:.1f} output tok/s, "
                f"ITL p50 {r['itl_p50_ms']:.1f} ms, p99 {r['itl_p99_ms']:.1f} ms",
                flush=True,
            )
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
            "loadavg_before": os.getloadavg(),
        },
        "best": {arm: best(r) for arm, r in runs.items()},
        "runs": runs,
    }
    b, m = result["best"]["base"], result["best"]["mixed4"]
    result["mixed4_vs_base"] = m["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else 0.0
    result["conditions"]["loadavg_after"] = os.getloadavg()
    written = out_path(args.out, "lora")
    written.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["best"], indent=2))
    print(f"mixed4 / base output tok/s: {result['mixed4_vs_base']:.3f}; written to {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
