"""Does mapping the weights from a shared-memory file slow the engine? Two engines in one
process, one with private weights and one with the shared file, run the same steps in turn.

    python benchmarks/shared_weights.py [--out shared_weights.json]

Per engine: the median seconds of a forward pass over 1 and 16 decode rows and over a
128-token prefill chunk (fp32 + int4, one thread: the shape of a `tokenyard up` worker on
a CPU without native bf16), alternating engines rep by rep so load drifts hit both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from result_path import OUT_HELP, out_path

from tokenyard.engine.config import EngineConfig
from tokenyard.engine.llm_engine import LLMEngine
from tokenyard.engine.model_runner import InputSpan
from tokenyard.models.loader import load_model

SHAPES = {"decode x1": (1, 1), "decode x16": (16, 1), "prefill 128": (1, 128)}


def spans(rows: int, tokens: int) -> list[InputSpan]:
    # Each row: a sequence with 64 tokens of context in blocks 16*i.., then `tokens` new ones.
    return [
        InputSpan(list(range(100, 100 + tokens)), 64, list(range(16 * i, 16 * i + 16)))
        for i in range(rows)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loaded = load_model()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        engines = {
            name: LLMEngine(
                EngineConfig(
                    dtype="float32",
                    quantization="int4",
                    kv_cache_bytes=256 * 1024**2,
                    shared_weights_dir=shm if name == "shared" else None,
                ),
                loaded=loaded,
            )
            for name in ("private", "shared")
        }
        times: dict[str, dict[str, list[float]]] = {n: {s: [] for s in SHAPES} for n in engines}
        for _ in range(args.reps):
            for shape, (rows, tokens) in SHAPES.items():
                for name, engine in engines.items():
                    started = time.perf_counter()
                    engine.runner.forward(spans(rows, tokens))
                    times[name][shape].append(time.perf_counter() - started)
    result = {
        "threads": 1,
        "reps": args.reps,
        "median_ms": {
            n: {s: round(statistics.median(v[1:]) * 1e3, 2) for s, v in by.items()}
            for n, by in times.items()
        },
    }
    out = out_path(args.out, "shared_weights")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median_ms"], indent=2))  # noqa: T201
    print(f"wrote {out}")  # noqa: T201


if __name__ == "__main__":
    main()
