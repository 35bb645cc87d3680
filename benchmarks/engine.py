"""Engine benchmark: Tokenyard's engine against HF transformers `generate`, same model, same run.

    python benchmarks/engine.py [--out engine.json]

Scenarios (every side runs in its own fresh process, so peak memory is its own):
  a) one request, 128 prompt tokens, 128 output tokens: TTFT and decode tok/s;
  b) 32 requests arriving together, 128 prompt + 128 output tokens each (EOS ignored):
     output tok/s, TTFT and inter-token latency p50/p99. HF runs them as 4 static batches of 8.
  c) with --worker closed:<dtype>:<quantization> --requests N: the bench client's load shape
     in process (what benchmarks/peers.py compares the stack with): 32 requests in flight,
     a new one added as each finishes, N in all, the engine configured as a worker is.
Also: peak RSS, KV pool use, and the machine's limit for (a): measured memory bandwidth over
the bytes of weights one decode step reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from result_path import OUT_HELP, out_path

PROMPT_LEN = 128
OUTPUT_LEN = 128
NUM_CONCURRENT = 32
HF_BATCH = 8


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    words = [
        "serving",
        "large",
        "language",
        "models",
        "at",
        "scale",
        "needs",
        "batching",
        "paged",
        "memory",
        "careful",
        "scheduling",
        "fast",
        "kernels",
        "and",
        "a",
        "router",
        "that",
        "knows",
        "where",
        "every",
        "cached",
        "block",
        "lives",
        "across",
        "the",
        "fleet",
    ]
    # Each prompt its own words in its own order, so that no two share a cached prefix block
    # (prefix-cache hits would flatter the engine): the stack's bench client sends distinct
    # prompts too.
    out = []
    for i in range(n):
        rng = random.Random(i)
        text = " ".join(rng.choice(words) for _ in range(length * 2))
        out.append(tokenizer.encode(text, add_special_tokens=False)[:length])
    assert len({tuple(p[:16]) for p in out}) == n, "two prompts share their first block"
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(
    first: dict[Any, float], times: dict[Any, list[float]], start: float, end: float
) -> dict:
    ttft = [first[r] - start for r in first]
    itl = [b - a for ts in times.values() for a, b in zip(ts, ts[1:], strict=False)]
    n_out = sum(len(ts) for ts in times.values())
    return {
        "output_tokens": n_out,
        "wall_s": end - start,
        "output_tok_s": n_out / (end - start),
        "ttft_ms_p50": 1e3 * pct(ttft, 0.5),
        "ttft_ms_p99": 1e3 * pct(ttft, 0.99),
        "itl_ms_p50": 1e3 * pct(itl, 0.5),
        "itl_ms_p99": 1e3 * pct(itl, 0.99),
    }


def single_summary(times: list[float], start: float) -> dict:
    decode = times[-1] - times[0]
    return {
        "ttft_ms": 1e3 * (times[0] - start),
        "decode_tok_s": (len(times) - 1) / decode,
        "output_tokens": len(times),
    }


# --- our engine -----------------------------------------------------------------------------


def run_ours(
    dtype: str, quantization: str | None, prompt_len: int = PROMPT_LEN, model: str | None = None
) -> dict:
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine
    from tokenyard.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=64,
            max_num_batched_tokens=1024,
            kv_cache_bytes=1024**3,
            enable_prefix_caching=False,
        )
    )
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    batch = prompts(engine.tokenizer, NUM_CONCURRENT, prompt_len)
    _drive(
        engine, {"warm": batch[0]}, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    first, times, start, end, _ = _drive(engine, {"one": batch[0]}, params)
    single = single_summary(times["one"], start)
    reqs = {f"r{i}": p for i, p in enumerate(batch)}
    first, times, start, end, peak_blocks = _drive(engine, reqs, params)
    assert engine.layout is not None  # one rank: the engine holds its KV pool
    result: dict[str, Any] = {"single": single, "concurrent": summarize(first, times, start, end)}
    result["kv_pool"] = {
        "num_blocks": engine.block_manager.num_blocks,
        "peak_used_blocks": peak_blocks,
        "peak_used_fraction": peak_blocks / engine.block_manager.num_blocks,
        "bytes_per_block": engine.layout.block_nbytes,
    }
    result["memory_report"] = engine.memory.__dict__
    result["weights_bytes_per_decode_step"] = engine.memory.decode_read_bytes
    return result


def run_closed_loop(
    dtype: str, quantization: str | None, prompt_len: int, total: int, model: str | None = None
) -> dict:
    """Scenario (c): NUM_CONCURRENT requests in flight until ``total`` have run, each
    replaced as it finishes (a closed-loop client), on an engine with a worker's limits."""
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine
    from tokenyard.engine.sampling_params import SamplingParams
    from tokenyard.services.worker.settings import WorkerSettings

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_num_seqs=WorkerSettings().max_num_seqs,
            kv_cache_bytes=1024**3,
        )
    )
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    batch = prompts(engine.tokenizer, total, prompt_len)
    _drive(engine, {"warm": batch[0]}, SamplingParams(max_tokens=4, temperature=0.0))
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    sent_at: dict[str, float] = {}
    sent = 0

    def send() -> None:
        nonlocal sent
        rid = f"r{sent}"
        times[rid], sent_at[rid] = [], time.perf_counter()
        engine.add_request(rid, batch[sent], params)
        sent += 1

    start = time.perf_counter()
    while sent < min(NUM_CONCURRENT, total):
        send()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            times[o.request_id].extend([now] * len(o.new_token_ids))
            if o.finished and sent < total:
                send()
    result = summarize(first, times, start, time.perf_counter())
    ttft = [first[r] - sent_at[r] for r in first]  # from each request's own send
    result.update(ttft_ms_p50=1e3 * pct(ttft, 0.5), ttft_ms_p99=1e3 * pct(ttft, 0.99))
    result.update(requests=total, prompt_len=prompt_len)
    return {"closed_loop": result}


def _drive(engine, reqs: dict[str, list[int]], params):
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {r: [] for r in reqs}
    start = time.perf_counter()
    for rid, p in reqs.items():
        engine.add_request(rid, p, params)
    peak = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        peak = max(peak, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
        for o in outs:
            first.setdefault(o.request_id, now)
            times[o.request_id].append(now)
    return first, times, start, time.perf_counter(), peak


# --- HF transformers --------------------------------------------------------------------------


def run_hf() -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    from tokenyard.models.loader import load_model

    loaded = load_model()
    c = loaded.config
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,  # type: ignore[call-arg]  # transformers 5: a legacy keyword
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=True,
            pad_token_id=2,
        )
    ).eval()
    model.load_state_dict(loaded.weights, strict=False)
    model.tie_weights()
    tokenizer = loaded.tokenizer
    del loaded

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def generate(batch: list[list[int]]) -> list[float]:
        clock = Clock()
        ids = torch.tensor(batch)
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=OUTPUT_LEN,
                min_new_tokens=OUTPUT_LEN,
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
            )
        return clock.times

    batch = prompts(tokenizer, NUM_CONCURRENT, PROMPT_LEN)
    generate([batch[0][:8]])  # warm-up
    start = time.perf_counter()
    single = single_summary(generate([batch[0]]), start)
    first: dict[int, float] = {}
    times: dict[int, list[float]] = {}
    start = time.perf_counter()
    for b in range(0, NUM_CONCURRENT, HF_BATCH):  # static batches: all 32 arrived at `start`
        step_times = generate(batch[b : b + HF_BATCH])
        for r in range(b, b + HF_BATCH):
            first[r], times[r] = step_times[0], step_times
    return {"single": single, "concurrent": summarize(first, times, start, time.perf_counter())}


# --- the machine ------------------------------------------------------------------------------


def memory_bandwidth_gbs() -> float:
    import torch

    a = torch.ones(512 * 1024**2 // 4)
    a.sum()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def worker(
    kind: str,
    threads: int,
    prompt_len: int = PROMPT_LEN,
    requests: int = 0,
    model: str | None = None,
) -> None:
    import torch

    torch.set_num_threads(threads)
    if kind == "hf":
        result = run_hf()
    elif kind.startswith("closed:"):
        _, dtype, quant = kind.split(":")
        total = requests or 2 * NUM_CONCURRENT
        result = run_closed_loop(dtype, quant or None, prompt_len, total, model)
    else:
        _, dtype, quant = kind.split(":")
        result = run_ours(dtype, quant or None, prompt_len, model)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def spawn(kind: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument(
        "--configs",
        default="ours:float32:,ours:bfloat16:,ours:bfloat16:int8,ours:bfloat16:int4,ours:float32:int4",
        help="ours:<dtype>:<quantization> entries, comma-separated",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=PROMPT_LEN,
        help="prompt tokens of our engine's requests (a --worker run; the table keeps 128)",
    )
    parser.add_argument("--requests", type=int, default=0, help="closed-loop total (scenario c)")
    parser.add_argument(
        "--model",
        help="our engine's model in a --worker run: a .gguf file or an HF folder (default: "
        "the default model; benchmarks/peers.py --shape passes a shape's folder)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.threads, args.prompt_len, args.requests, args.model)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    results: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "platform": platform.platform(),
            "torch": torch.__version__,
            "memory_read_gbs": memory_bandwidth_gbs(),
        },
        "workload": {
            "prompt_len": PROMPT_LEN,
            "output_len": OUTPUT_LEN,
            "concurrent": NUM_CONCURRENT,
            "hf_static_batch": HF_BATCH,
        },
    }
    out = out_path(args.out, "engine")
    results["hf"] = hf = spawn("hf", args.threads)
    for kind in args.configs.split(","):
        r = spawn(kind, args.threads)
        bw = results["machine"]["memory_read_gbs"] * 1e9
        r["batch1_limit_tok_s"] = bw / r["weights_bytes_per_decode_step"]
        r["batch1_fraction_of_limit"] = r["single"]["decode_tok_s"] / r["batch1_limit_tok_s"]
        r["vs_hf"] = {
            "batch1_decode_speedup": r["single"]["decode_tok_s"] / hf["single"]["decode_tok_s"],
            "batch1_ttft_ratio": r["single"]["ttft_ms"] / hf["single"]["ttft_ms"],
            "concurrent_throughput_speedup": r["concurrent"]["output_tok_s"]
            / hf["concurrent"]["output_tok_s"],
        }
        results[kind] = r
    out.write_text(json.dumps(results, indent=2))
    _print_table(results)
    _plot(results, out.with_name(out.stem + "_plots") / "engine.png")
    return 0


def _plot(results: dict, path: Path) -> None:
    """Two bar charts, batch-1 decode and 32-request throughput, each engine against HF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["hf"] + [k for k in results if k.startswith("ours")]
    labels = [
        "HF fp32" if n == "hf" else n.removeprefix("ours:").rstrip(":").replace(":", "+")
        for n in names
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (scenario, field, title, target) in zip(
        axes,
        [
            ("single", "decode_tok_s", "one request: decode tok/s", 3),
            ("concurrent", "output_tok_s", "32 requests: output tok/s", 4),
        ],
        strict=True,
    ):
        values = [results[n][scenario][field] for n in names]
        ax.bar(labels, values, color=["grey"] + ["tab:blue"] * (len(names) - 1))
        ax.axhline(target * values[0], color="tab:red", linestyle="--", label=f"{target}x HF")
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}\n{v / values[0]:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(max(values), target * values[0]) * 1.2)
        ax.set_title(title)
        ax.legend(loc="upper left")
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _print_table(results: dict) -> None:
    hf = results["hf"]
    print(f"memory read bandwidth: {results['machine']['memory_read_gbs']:.1f} GB/s")
    print(
        f"{'engine':28} {'b1 tok/s':>9} {'b1 TTFT ms':>10} {'32x tok/s':>10} {'TTFT p50':>9} {'ITL p50':>8} {'x HF b1':>8} {'x HF 32':>8}"
    )
    print(
        f"{'hf transformers fp32':28} {hf['single']['decode_tok_s']:9.1f} {hf['single']['ttft_ms']:10.1f} "
        f"{hf['concurrent']['output_tok_s']:10.1f} {hf['concurrent']['ttft_ms_p50']:9.0f} {hf['concurrent']['itl_ms_p50']:8.1f}"
    )
    for kind, r in results.items():
        if not kind.startswith("ours"):
            continue
        print(
            f"{kind:28} {r['single']['decode_tok_s']:9.1f} {r['single']['ttft_ms']:10.1f} "
            f"{r['concurrent']['output_tok_s']:10.1f} {r['concurrent']['ttft_ms_p50']:9.0f} "
            f"{r['concurrent']['itl_ms_p50']:8.1f} {r['vs_hf']['batch1_decode_speedup']:8.2f} "
            f"{r['vs_hf']['concurrent_throughput_speedup']:8.2f}"
        )


if __name__ == "__main__":
    sys.exit(main())
