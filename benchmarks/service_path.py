"""The service path against the in-process engine: what do NATS, the router and the
prefill -> decode hand-off cost?

Both sides get the same prompts (synthetic text, --input-tokens long), the same
max_tokens with ignore_eos and greedy sampling, at concurrency 1 and 16 (closed loop:
a new request starts when one ends).

- in-process: one LLMEngine in this process, stepped in a loop (no HTTP, no NATS);
- service: `LocalStack` (embedded NATS, router, 1 prefill + 1 decode worker, gateway, each
  its own process), every request disaggregated, streamed over HTTP (httpx, SSE).

Reported per concurrency: TTFT p50 on both sides and the difference ("added TTFT"), and
output tokens/s on both sides and their ratio. Targets: added TTFT p50 <= 15 ms,
throughput ratio >= 0.85. Writes a JSON report (`--out`, default in result_path.py).

    python benchmarks/service_path.py [--requests 8 32] [--max-tokens 64] [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from result_path import OUT_HELP, out_path

from tokenyard.bench.text import text_of_tokens
from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.stack import LocalStack, StackConfig

TARGET_ADDED_TTFT_MS = 15.0
TARGET_THROUGHPUT_RATIO = 0.85


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float
    output_tokens: int


@dataclass
class Summary:
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    output_tokens: int
    wall_s: float
    tokens_per_s: float


def summarize(samples: list[Sample], wall_s: float) -> Summary:
    ttfts = sorted(s.ttft_s * 1000 for s in samples)
    tokens = sum(s.output_tokens for s in samples)
    return Summary(
        requests=len(samples),
        ttft_p50_ms=round(statistics.median(ttfts), 2),
        ttft_p90_ms=round(ttfts[math.ceil(0.9 * len(ttfts)) - 1], 2),  # nearest rank
        output_tokens=tokens,
        wall_s=round(wall_s, 3),
        tokens_per_s=round(tokens / wall_s, 2),
    )


def make_prompts(n: int, input_tokens: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [text_of_tokens(rng, input_tokens) for _ in range(n)]


# --- in-process --------------------------------------------------------------------------


def run_inprocess(
    engine, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Sample], float]:
    from tokenyard.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = list(enumerate(prompts))
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    samples: list[Sample] = []
    t0 = time.perf_counter()

    def admit() -> None:
        while pending and len(started) - len(samples) < concurrency:
            i, prompt = pending.pop(0)
            rid = f"bench-{concurrency}-{i}"
            started[rid] = time.perf_counter()
            engine.add_request(rid, prompt, params)

    admit()
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                rid = out.request_id
                samples.append(
                    Sample(first[rid] - started[rid], now - started[rid], out.num_output_tokens)
                )
        admit()
    return samples, time.perf_counter() - t0


# --- service -----------------------------------------------------------------------------


async def one_streamed(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[5:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    return Sample(ttft if ttft is not None else end - start, end - start, tokens)


async def run_service(
    url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> tuple[list[Sample], float]:
    queue = list(prompts)
    samples: list[Sample] = []

    async def user(client: httpx.AsyncClient) -> None:
        while queue:
            prompt = queue.pop(0)
            samples.append(await one_streamed(client, model, prompt, max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(user(client))
        return samples, time.perf_counter() - t0


# --- plumbing only ----------------------------------------------------------------------


async def plumbing_ttft(url: str, n: int) -> list[float]:
    """TTFT through the whole path with the workers' fake engine (no compute): pure overhead."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for _ in range(n):
            sample = await one_streamed(client, "fake-model", "hello there, my friend", 4)
            out.append(sample.ttft_s * 1000)
    return out


def run_plumbing(args: argparse.Namespace) -> None:
    config = StackConfig(
        port=free_port(),
        engine="fake",
        kvcache=False,
        facilities=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env={"TOKENYARD_WORKER_FAKE_STEP_S": "0", "TOKENYARD_WORKER_LOG_LEVEL": "WARNING"},
        gateway_env={"TOKENYARD_GATEWAY_LOG_LEVEL": "warning"},
    )
    with LocalStack(config) as stack:
        stack.wait_ready(timeout=120)
        ttfts = asyncio.run(plumbing_ttft(stack.gateway_url, args.plumbing + 5))[5:]
    ttfts.sort()
    report = {
        "what": "TTFT of gateway -> router -> prefill -> decode with a zero-cost fake engine:"
        " the service path's own overhead (HTTP, tokenization, NATS, JetStream, SSE)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "requests": len(ttfts),
        "ttft_p50_ms": round(statistics.median(ttfts), 2),
        "ttft_p90_ms": round(ttfts[math.ceil(0.9 * len(ttfts)) - 1], 2),
        "target_added_ttft_p50_ms_max": TARGET_ADDED_TTFT_MS,
    }
    out = args.out.with_name(args.out.stem + "_plumbing.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {out}")


# --- main --------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument(
        "--requests", type=int, nargs="+", default=[8, 32], help="requests per concurrency level"
    )
    ap.add_argument("--input-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    ap.add_argument(
        "--inproc-threads", type=int, default=0, help="torch threads in-process (0 = all cores)"
    )
    ap.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="torch threads per worker (0 = the launcher's share: cores / workers)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; medians reported")
    ap.add_argument(
        "--plumbing",
        type=int,
        default=0,
        metavar="N",
        help="instead: N requests through the stack with the fake engine (overhead only)",
    )
    ap.add_argument("--out", type=Path, help=OUT_HELP)
    args = ap.parse_args()
    args.out = out_path(args.out, "service_path")
    if args.plumbing:
        run_plumbing(args)
        return
    if len(args.requests) != len(args.concurrency):
        ap.error("give one --requests figure per --concurrency level")
    levels = list(zip(args.concurrency, args.requests, strict=True))
    prompt_sets = {c: make_prompts(n, args.input_tokens, seed=1000 + c) for c, n in levels}
    warmup = make_prompts(2, args.input_tokens, seed=7)

    worker_env = {
        "TOKENYARD_WORKER_KV_CACHE_BYTES": str(args.kv_cache_bytes),
        "TOKENYARD_WORKER_LOG_LEVEL": "WARNING",
    }
    if args.worker_threads:
        worker_env["TOKENYARD_WORKER_NUM_THREADS"] = str(args.worker_threads)
    config = StackConfig(
        port=free_port(),
        kvcache=False,
        facilities=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env=worker_env,
        gateway_env={"TOKENYARD_GATEWAY_LOG_LEVEL": "warning"},
    )
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine

    inproc: dict[int, list[Summary]] = {c: [] for c, _ in levels}
    service: dict[int, list[Summary]] = {c: [] for c, _ in levels}
    with LocalStack(config) as stack:
        stack.wait_ready(timeout=600)
        engine = LLMEngine(
            EngineConfig(
                kv_cache_bytes=args.kv_cache_bytes,
                num_threads=args.inproc_threads or os.cpu_count(),
            )
        )
        url, model = stack.gateway_url, stack.model_id
        run_inprocess(engine, warmup, 2, args.max_tokens)
        asyncio.run(run_service(url, model, warmup, 2, args.max_tokens))
        # NOTE: the two sides alternate level by level and round by round, so a noisy
        # neighbour on a shared machine hits both rather than one.
        for r in range(args.rounds):
            for c, _ in levels:
                prompts = [f"{r} {p}" for p in prompt_sets[c]]  # no prefix hits across rounds
                samples, wall = run_inprocess(engine, prompts, c, args.max_tokens)
                inproc[c].append(summarize(samples, wall))
                print(f"round {r} in-process c={c:<3} {inproc[c][-1]}", flush=True)
                samples, wall = asyncio.run(run_service(url, model, prompts, c, args.max_tokens))
                service[c].append(summarize(samples, wall))
                print(f"round {r} service    c={c:<3} {service[c][-1]}", flush=True)

    results: dict[str, dict] = {}
    report = {
        "what": "gateway -> router -> prefill -> decode (disaggregated, streamed SSE) vs the in-process engine",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "note": "every service process and the client share these CPUs with each other"
            " (and with anything else running); the in-process run had them alone",
        },
        "config": {
            "input_tokens": args.input_tokens,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "levels": [{"concurrency": c, "requests": n} for c, n in levels],
            "rounds": args.rounds,
            "torch_threads_in_process": args.inproc_threads or os.cpu_count(),
            "torch_threads_per_worker": args.worker_threads or "cores / workers",
        },
        "targets": {
            "added_ttft_p50_ms_max": TARGET_ADDED_TTFT_MS,
            "throughput_ratio_min": TARGET_THROUGHPUT_RATIO,
        },
        "results": results,
    }
    for c, _ in levels:
        ttft_in = statistics.median(x.ttft_p50_ms for x in inproc[c])
        ttft_sv = statistics.median(x.ttft_p50_ms for x in service[c])
        tps_in = statistics.median(x.tokens_per_s for x in inproc[c])
        tps_sv = statistics.median(x.tokens_per_s for x in service[c])
        added = round(ttft_sv - ttft_in, 2)
        ratio = round(tps_sv / tps_in, 3)
        results[f"c{c}"] = {
            "in_process": {
                "ttft_p50_ms": ttft_in,
                "tokens_per_s": tps_in,
                "rounds": [asdict(x) for x in inproc[c]],
            },
            "service": {
                "ttft_p50_ms": ttft_sv,
                "tokens_per_s": tps_sv,
                "rounds": [asdict(x) for x in service[c]],
            },
            "added_ttft_p50_ms": added,
            "throughput_ratio": ratio,
            "meets_targets": added <= TARGET_ADDED_TTFT_MS and ratio >= TARGET_THROUGHPUT_RATIO,
        }
        print(f"c={c}: added TTFT p50 {added} ms, throughput ratio {ratio}")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
