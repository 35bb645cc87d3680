"""GPU figures for the engine: decode against the HBM bandwidth limit, prefill TFLOP/s.

    python benchmarks/gpu.py [--out gpu.json]     (needs CUDA)

- bandwidth: a large device-to-device copy, bytes read + written per second (best of 5);
- decode at batch 1 and batch 64 (128 prompt + 128 output tokens each, EOS ignored): output
  tok/s, and the limit the bandwidth sets: each step reads every weight once
  (MemoryReport.decode_read_bytes) plus each sequence's KV so far, so
  limit tok/s = batch * bandwidth / (weight bytes + batch * mean context * KV bytes per token);
- prefill: one prompt of 2048 tokens in one step, tokens/s and TFLOP/s counted as
  2 * parameters * tokens (matmuls only; attention's share is left out).
scripts/gpu_check.sh runs it after the kernel and HF-equivalence tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from result_path import OUT_HELP, out_path

PROMPT_LEN = 128
OUTPUT_LEN = 128
PREFILL_LEN = 2048


def bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best  # read + write


def decode(engine, batch: int, bw: float) -> dict:
    from tokenyard.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 131 + j * 7) % 20000 + 100 for j in range(PROMPT_LEN)]
        engine.add_request(f"d{batch}-{i}", prompt, params)
    first: set[str] = set()
    while len(first) < batch:  # prefill everything first, then time decode alone
        first |= {out.request_id for out in engine.step()}
    torch.cuda.synchronize()
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - started
    kv_per_token = engine.layout.block_nbytes // engine.layout.block_size
    mean_context = PROMPT_LEN + OUTPUT_LEN / 2
    step_bytes = engine.memory.decode_read_bytes + batch * mean_context * kv_per_token
    limit = batch * bw / step_bytes
    return {
        "batch": batch,
        "output_tok_s": tokens / seconds,
        "limit_tok_s": limit,
        "share_of_limit": tokens / seconds / limit,
        "bytes_per_step": step_bytes,
    }


def prefill(engine) -> dict:
    from tokenyard.engine.sampling_params import SamplingParams

    prompt = [(j * 13) % 20000 + 100 for j in range(PREFILL_LEN)]
    engine.add_request("warm", prompt[:64], SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("p", prompt, SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    params = engine.memory.weights_bytes / 2  # bfloat16: two bytes a parameter
    return {
        "prompt_tokens": PREFILL_LEN,
        "tokens_s": PREFILL_LEN / seconds,
        "tflop_s": 2 * params * PREFILL_LEN / seconds / 1e12,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--model", help="a .gguf file or HF folder (default: the default model)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU; none is visible here")
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    device = torch.device("cuda")
    bw = bandwidth(device)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=64,
            max_num_batched_tokens=PREFILL_LEN,
        )
    )
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": engine.model_id,
        "memory": engine.memory.describe(),
        "bandwidth_gb_s": bw / 1e9,
        "decode": [decode(engine, 1, bw), decode(engine, 64, bw)],
        "prefill": prefill(engine),
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 1024**3,
    }
    out = out_path(args.out, "gpu")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
