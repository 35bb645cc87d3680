"""Speculative decoding benchmark: each case against plain decoding, measured in one run.

    python benchmarks/spec_decode.py [--out spec_decode.json]

Cases (arms alternate, best of --repeats each, so a busy machine hits both alike):
  copy:    batch 1, a copy-heavy prompt (quote a passage back), n-gram prompt lookup, on the
           shipped precision (bf16 weights, int4 for small batches) and on plain bf16;
  chat:    batch 1, chat questions, the int4 self-draft of a bf16 target;
  batch:   n-gram speed-up at batch sizes 1..8 on the copy workload with speculation never
           switched off: where it stops paying sets `disable_by_batch_size`;
  c32:     32 concurrent chat requests, output tok/s with and without each method (with the
           default switch-off rule in force).
Decode speed is output tokens after the first over the time after the first token.
Figures are ratios to the plain arm of the same case; absolute numbers depend on the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from result_path import OUT_HELP, out_path

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.models.loader import LoadedModel, load_model

PASSAGE = (
    "The harbour office opens at seven. Ships that arrive before then wait at the outer "
    "buoy, keep their engines idle, and call the pilot on channel twelve. Cargo papers go "
    "to the second window; passenger lists go to the first. Fuel is sold from the east quay "
    "only, and the crane on the west quay is out of service until the end of the month."
)
COPY_PROMPT = f"Repeat the following notice word for word.\n\n{PASSAGE}"
CHAT_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Give three tips for writing clear emails.",
    "What is the difference between a list and a tuple in Python?",
    "Describe how a bicycle gear works.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
SELF_DRAFT = {"method": "draft", "model": None, "quantization": "int4", "num_speculative_tokens": 3}
NEVER_OFF = 1_000_000


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def run_batch(engine: LLMEngine, prompts: list[Any], max_tokens: int) -> dict[str, float]:
    """Run prompts together to the end: decode tok/s after each one's first token, and
    output tok/s over the whole run."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter())
    end = time.perf_counter()
    decode_s = sum(end - t for t in first.values()) / len(first)
    return {
        "decode_tok_s": (max_tokens - 1) / decode_s,
        "output_tok_s": max_tokens * len(prompts) / (end - start),
    }


def compare(
    loaded: LoadedModel,
    base: dict[str, Any],
    spec: dict[str, Any],
    prompts: list[Any],
    max_tokens: int,
    repeats: int,
    key: str,
) -> dict[str, Any]:
    engines = {
        "plain": LLMEngine(EngineConfig(**base), loaded=loaded),
        "spec": LLMEngine(EngineConfig(**base, speculative_config=spec), loaded=loaded),
    }
    for engine in engines.values():  # warm up: first touch of the KV pool's pages included
        run_batch(engine, prompts, 4)
    before = engines["spec"].stats()
    best: dict[str, float] = {"plain": 0.0, "spec": 0.0}
    for _ in range(repeats):
        for arm, engine in engines.items():
            best[arm] = max(best[arm], run_batch(engine, prompts, max_tokens)[key])
    after = engines["spec"].stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {
        "metric": key,
        "plain": round(best["plain"], 2),
        "spec": round(best["spec"], 2),
        "speedup": round(best["spec"] / best["plain"], 3),
        "verifications": drafts,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--skip-c32", action="store_true", help="leave out the 32-concurrent case")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model()
    shipped = {"dtype": "bfloat16", "quantization": "int4", "kv_cache_bytes": 256 * 1024**2}
    bf16 = {"dtype": "bfloat16", "kv_cache_bytes": 256 * 1024**2}
    n, r = args.max_tokens, args.repeats
    copy = [chat(COPY_PROMPT)]
    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": os.getloadavg(),
            "note": "shared machine: compare ratios within this run, not absolute figures",
        },
        "max_tokens": n,
    }
    results["copy_ngram_batch1"] = {
        "bf16_int4": compare(loaded, shipped, NGRAM, copy, n, r + 1, "decode_tok_s"),
        "bf16": compare(loaded, bf16, NGRAM, copy, n, r + 1, "decode_tok_s"),
    }
    print("copy", results["copy_ngram_batch1"], flush=True)
    results["chat_self_draft_batch1"] = {
        prompt[:24]: compare(loaded, bf16, SELF_DRAFT, [chat(prompt)], n, 1, "decode_tok_s")
        for prompt in CHAT_PROMPTS[:r]
    }
    print("chat", results["chat_self_draft_batch1"], flush=True)
    never_off = {**NGRAM, "disable_by_batch_size": NEVER_OFF}
    results["ngram_by_batch_size"] = {
        b: compare(loaded, shipped, never_off, copy * b, n // 2, r, "output_tok_s")
        for b in (1, 2, 4, 8)
    }
    print("by batch", results["ngram_by_batch_size"], flush=True)
    if not args.skip_c32:
        many = [chat(CHAT_PROMPTS[i % len(CHAT_PROMPTS)] + f" (#{i})") for i in range(32)]
        results["c32"] = {
            "ngram": compare(loaded, shipped, NGRAM, many, n // 2, r, "output_tok_s"),
            "self_draft": compare(loaded, bf16, SELF_DRAFT, many, n // 2, r, "output_tok_s"),
        }
        print("c32", results["c32"], flush=True)
    out = out_path(args.out, "spec_decode")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
