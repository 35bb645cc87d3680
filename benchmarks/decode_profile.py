"""Where a decode step goes at a model's shape, against the host's memory roofline.

    .venv/bin/python benchmarks/decode_profile.py --shape llama-3.2-1b [--batch 1,8,32] \
        [--context 256] [--steps 48] [--out decode_profile.json]

The engine is built as `tokenyard up` builds a CPU worker's (dtype auto, int4 weights unless
--quantization says otherwise). For each batch size, that many requests of --context prompt
tokens are prefilled, then --steps decode steps are timed one by one (wall clock around
`engine.step()`, so the scheduler, the sampler and the detokenizer are in it). Then the same
steps run again under `py-spy record --native`, which samples every thread of this process
(OpenMP's included), and each sample is put in one bucket by the innermost frame that names
a known part: the projections' weight kernels, attention, norms and rotary, the output
projection and sampling, the engine's Python. The roofline: the bytes one step must read
(every weight once, `engine.memory.decode_read_bytes`, plus the KV of the context) over the
host's read bandwidth measured in this run (benchmarks/engine.py's probe).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from engine import memory_bandwidth_gbs, prompts  # benchmarks/engine.py, beside this script
from result_path import OUT_HELP, out_path

# Innermost matching frame wins; within one frame, earlier rows win. Native names are the
# C++ kernels' (OpenMP's outlined regions keep their parent's name) and torch's own.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    (
        "attention",
        ("decode_attention", "span_attention", "write_kv", "gather_kv", "attend", "attention"),
    ),
    ("norm, rotary, silu", ("rms_norm", "rotary", "silu", "rope")),
    (
        "projection weights (GEMV/GEMM)",
        (
            "int4_linear",
            "int8_linear",
            "linear_i16",
            "linear_i8",
            "linear_amx",
            "linear_bf16",
            "gemv",
            "gemm",
            "dot_",
            "mkl_",
            "sgemm",
            "dnnl",
            "_linear",
        ),
    ),
    ("output projection", ("logits", "lm_head")),
    ("sampling", ("argmax", "sample", "sampler", "softmax", "topk")),
    ("decoder_layers (unattributed C++)", ("decoder_layers",)),
    ("scheduler", ("scheduler", "block_manager")),
    ("detokenize", ("detoken", "tokenizer", "tokenizers")),
    ("engine Python", ("tokenyard",)),
]
# A thread asleep (not counted) and an OpenMP thread spinning at a barrier (counted apart: a
# worker thread waits there while the main thread runs Python or serial work).
IDLE = ("nanosleep", "futex", "epoll_wait", "pthread_cond", "sem_wait", "poll", "select")
SPIN = ("libgomp",)


def build_engine(model: str | None, dtype: str, quantization: str | None, kv_mib: int):
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            kv_cache_bytes=kv_mib * 1024**2,
            enable_prefix_caching=False,
        )
    )


def prefill(engine, batch: int, context: int, steps: int, tag: str) -> None:
    """Add `batch` requests of `context` prompt tokens and step until each has its first token
    (chunked as the engine schedules it); they then decode for `steps` more steps at least."""
    from tokenyard.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(engine.tokenizer, batch, context)):
        engine.add_request(f"{tag}-{i}", p, params)
    produced: set[str] = set()
    while len(produced) < batch:
        produced.update(out.request_id for out in engine.step())


def decode_steps(engine, steps: int) -> list[float]:
    """Time `steps` decode steps (seconds each)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def finish(engine, batch: int, tag: str) -> None:
    for i in range(batch):
        engine.abort(f"{tag}-{i}")
    while engine.has_unfinished():
        engine.step()


def bucket(frames: list[str]) -> str:
    """frames: innermost first."""
    for frame in frames:
        low = frame.lower()
        for name, needles in BUCKETS:
            if any(n in low for n in needles):
                return name
    return "other"


def profile(engine, steps: int, rate: int, keep: Path | None = None) -> dict[str, Any]:
    """py-spy --native over the next `steps` decode steps of the running requests: sample
    shares by bucket, busy samples only."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.txt"
        proc = subprocess.Popen(
            [
                spy,
                "record",
                "--native",
                "--threads",
                "--idle",
                "--format",
                "raw",
                "--rate",
                str(rate),
                "--pid",
                str(os.getpid()),
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.5)  # py-spy attaches
        decode_steps(engine, steps)
        proc.send_signal(2)
        _, err = proc.communicate(timeout=60)
        if not raw.exists():
            return {"error": err.decode()[-2000:]}
        counts: Counter[str] = Counter()
        idle = 0
        top: Counter[str] = Counter()
        threads: dict[str, Counter[str]] = {"main thread": Counter(), "other threads": Counter()}
        for line in raw.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")[::-1]  # innermost first
            inner = frames[0].lower() if frames else ""
            if any(p in inner for p in IDLE):
                idle += int(n)
                continue
            main = any("decode_steps" in f for f in frames)
            name = "OpenMP barrier spin" if any(p in inner for p in SPIN) else bucket(frames)
            counts[name] += int(n)
            threads[("main thread" if main else "other threads")][name] += int(n)
            top[frames[0][:120]] += int(n)
        if keep:
            shutil.copy(raw, keep)
    busy = sum(counts.values()) or 1
    return {
        "busy_samples": busy,
        "idle_samples": idle,
        "share": {k: round(v / busy, 4) for k, v in counts.most_common()},
        "by_thread": {
            t: {k: round(v / busy, 4) for k, v in c.most_common()} for t, c in threads.items()
        },
        "top_frames": {k: round(v / busy, 4) for k, v in top.most_common(15)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--shape", help="a benchmarks/model_shapes.py shape (written on first use)")
    where.add_argument("--model", help="a .gguf file or an HF folder (default: the default model)")
    parser.add_argument("--batch", default="1,8,32", help="comma list of batch sizes")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per batch")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="int4", help="int4, int8 or none")
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--no-profile", action="store_true", help="timings only")
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw samples in this folder")
    parser.add_argument(
        "--dense-above",
        type=int,
        help="every layer takes its dense copy above this many rows (default: the thresholds "
        "of tokenyard.models.kernel_choice), to find where the two cross at this shape",
    )
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    args = parser.parse_args()

    import torch

    model = args.model
    if args.shape:
        import model_shapes

        model = str(model_shapes.ensure(args.shape))
    if args.dense_above is not None:
        from tokenyard.models import kernel_choice

        for table in kernel_choice.DENSE_ABOVE_ROWS.values():
            for bits in table:
                table[bits] = args.dense_above
    read_gbs = memory_bandwidth_gbs()
    quant = None if args.quantization == "none" else args.quantization
    engine = build_engine(model, args.dtype, quant, args.kv_cache_mib)
    prefill(engine, 1, 16, 4, "warm")
    decode_steps(engine, 4)
    finish(engine, 1, "warm")
    weights = engine.memory.decode_read_bytes
    assert engine.layout is not None
    kv_per_token = engine.layout.block_nbytes / engine.layout.block_size
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "memory_read_gbs": round(read_gbs, 2),
        },
        "model": args.shape or model or "default",
        "dtype": str(engine.config.dtype),
        "quantization": args.quantization,
        "dense_above": args.dense_above,
        "weights_bytes_per_step": weights,
        "kv_bytes_per_token": kv_per_token,
        "context": args.context,
        "batches": {},
    }
    for batch in (int(b) for b in args.batch.split(",")):
        prefill(engine, batch, args.context, 2 * args.steps, f"b{batch}")
        times = sorted(decode_steps(engine, args.steps))
        step = times[len(times) // 2]
        # Mean context over the timed steps: the prompt plus half the steps.
        read = weights + batch * (args.context + args.steps / 2) * kv_per_token
        roofline_step = read / (read_gbs * 1e9)
        row: dict[str, Any] = {
            "step_ms_p50": round(step * 1e3, 3),
            "tok_s": round(batch / step, 2),
            "bytes_per_step": int(read),
            "achieved_gbs": round(read / step / 1e9, 2),
            "roofline_tok_s": round(batch / roofline_step, 2),
            "fraction_of_roofline": round(roofline_step / step, 3),
        }
        if not args.no_profile:
            keep = args.raw / f"py-spy-batch{batch}.txt" if args.raw else None
            row["profile"] = profile(engine, args.steps, args.rate, keep)
        finish(engine, batch, f"b{batch}")
        results["batches"][str(batch)] = row
        print(
            f"batch {batch}: {row['step_ms_p50']} ms/step, {row['tok_s']} tok/s, "
            f"{row['fraction_of_roofline']:.0%} of the roofline "
            f"({row['achieved_gbs']} of {read_gbs:.1f} GB/s)"
        )
        for name, share in row.get("profile", {}).get("share", {}).items():
            print(f"    {name:36s} {share:6.1%}")
    out = out_path(args.out, "decode_profile")
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
