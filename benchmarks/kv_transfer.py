"""KV hand-off throughput per transport, against a plain memcpy of the same bytes.

The hand-off is a 2,000-token prompt in the SmolLM2-135M layout (30 layers x K/V x 3 heads
x 64 dims, float32, blocks of 16 tokens): 125 blocks, about 92 MB, at scattered block ids as
a busy pool has them. The sender runs in its own process (its pool in shared memory);
``inproc`` has a sender in this process. Each figure is the median of --reps whole pulls
(Describe + bytes + Release). Writes a JSON report (`--out`, default in result_path.py).

    python benchmarks/kv_transfer.py [--reps 5] [--no-ttft] [--out kv_transfer.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path

import torch
from result_path import OUT_HELP, out_path

from tokenyard.kv.layout import KVLayout
from tokenyard.kv.transfer import (
    KVTransferClient,
    KVTransferServer,
    KVTransferSettings,
    allocate_shared_pool,
)
from tokenyard.kv.transfer import mooncake as mooncake_mod
from tokenyard.kv.transfer.common import copy_blocks

LAYOUT = KVLayout(
    "SmolLM2-135M-Instruct", "float32", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64
)
PROMPT_TOKENS = 2000
NUM_BLOCKS = PROMPT_TOKENS // LAYOUT.block_size  # 125
POOL_BLOCKS = 320
TRANSPORTS = ["shm", "mooncake", "grpc"]


def block_ids(seed: int) -> list[int]:
    return torch.randperm(POOL_BLOCKS, generator=torch.Generator().manual_seed(seed))[
        :NUM_BLOCKS
    ].tolist()


SRC, DST = block_ids(1), block_ids(2)


def _sender(reps: int, endpoints: mp.Queue, done) -> None:
    async def main() -> None:
        pool, _ = allocate_shared_pool(LAYOUT, POOL_BLOCKS)
        pool.copy_(torch.randn(pool.shape, generator=torch.Generator().manual_seed(0)))
        server = KVTransferServer(pool, LAYOUT, on_release=lambda rid: None, hold_timeout_s=120)
        endpoints.put(await server.start())
        for transport in TRANSPORTS:
            for i in range(reps + 1):
                server.offer(f"{transport}-{i}", SRC)
        await asyncio.to_thread(done.wait, 600)
        await server.stop(0)

    asyncio.run(main())


def median_gbps(seconds: list[float]) -> float:
    return NUM_BLOCKS * LAYOUT.block_nbytes / statistics.median(seconds) / 1e9


class Memcpy:
    """The baseline: the same blocks copied pool to pool in this process. Timed right
    before every pull, so a busy machine slows both alike."""

    def __init__(self) -> None:
        self.src = torch.randn(LAYOUT.pool_shape(POOL_BLOCKS))
        self.dst = torch.zeros_like(self.src)
        self.s_idx, self.d_idx = torch.tensor(SRC), torch.tensor(DST)
        self.direct: list[float] = []
        self.indexed: list[float] = []

    def once(self) -> float:
        t = time.perf_counter()
        copy_blocks(self.src, self.dst, SRC, DST)
        self.direct.append(time.perf_counter() - t)
        t = time.perf_counter()
        self.dst.index_copy_(0, self.d_idx, self.src.index_select(0, self.s_idx))
        self.indexed.append(time.perf_counter() - t)
        return min(self.direct[-1], self.indexed[-1])


async def pulls(
    client, endpoint, transport, reps, memcpy, offer=None
) -> tuple[list[float], list[float]]:
    """(pull seconds, memcpy seconds) per repetition, the first (warm-up) dropped."""
    pulled, copied = [], []
    for i in range(reps + 1):
        copied.append(memcpy.once())
        if offer is not None:
            offer(f"{transport}-{i}", SRC)
        result = await client.pull(endpoint, f"{transport}-{i}", SRC, DST)
        assert result.transport == transport, result
        pulled.append(result.seconds)
    return pulled[1:], copied[1:]


async def bench_inproc(reps: int, memcpy: Memcpy) -> tuple[list[float], list[float]]:
    src = torch.randn(LAYOUT.pool_shape(POOL_BLOCKS))
    dst = torch.zeros_like(src)
    server = KVTransferServer(src, LAYOUT, on_release=lambda rid: None, allowed=["inproc"])
    endpoint = await server.start()
    async with KVTransferClient(dst, LAYOUT, allowed=["inproc"]) as client:
        times = await pulls(client, endpoint, "inproc", reps, memcpy, offer=server.offer)
    await server.stop(0)
    assert torch.equal(dst[DST[7]], src[SRC[7]])
    return times


async def bench_remote(
    endpoint: str, transport: str, reps: int, memcpy: Memcpy
) -> tuple[list[float], list[float]]:
    dst = torch.zeros(LAYOUT.pool_shape(POOL_BLOCKS))
    expected = torch.randn(
        LAYOUT.pool_shape(POOL_BLOCKS), generator=torch.Generator().manual_seed(0)
    )
    settings = KVTransferSettings(allowed=[transport], timeout_s=60)
    async with KVTransferClient(dst, LAYOUT, settings=settings) as client:
        times = await pulls(client, endpoint, transport, reps, memcpy)
    assert torch.equal(dst[DST[7]], expected[SRC[7]]) and torch.equal(
        dst[DST[-1]], expected[SRC[-1]]
    )
    return times


async def run(reps: int) -> dict:
    memcpy = Memcpy()
    timings = {"inproc": await bench_inproc(reps, memcpy)}
    ctx = mp.get_context("spawn")
    endpoints, done = ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=_sender, args=(reps, endpoints, done), daemon=True)
    sender.start()
    skipped = {}
    try:
        endpoint = await asyncio.to_thread(endpoints.get, True, 120)
        for transport in TRANSPORTS:
            if transport == "mooncake" and mooncake_mod.process_engine("127.0.0.1", "tcp") is None:
                skipped[transport] = mooncake_mod.unavailable_reason()
                continue
            timings[transport] = await bench_remote(endpoint, transport, reps, memcpy)
    finally:
        done.set()
        sender.join(30)
        sender.kill()
    gbps = {
        "memcpy_block_copy": median_gbps(memcpy.direct),
        "memcpy_index_copy": median_gbps(memcpy.indexed),
        **{t: median_gbps(pulled) for t, (pulled, _) in timings.items()},
    }
    # Each transport against the memcpy timed beside it (same load on the machine).
    fraction = {
        t: statistics.median(copied) / statistics.median(pulled)
        for t, (pulled, copied) in timings.items()
    }
    return {"gbps": gbps, "fraction_of_memcpy": fraction, "skipped": skipped}


def first_token_seconds(engine, rid: str, prompt: list[int], **kwargs) -> tuple[float, int]:
    from tokenyard.engine.sampling_params import SamplingParams

    t = time.perf_counter()
    # NOTE: max_tokens=1 would finish a prefill-only request as "length" and free its blocks.
    engine.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0), **kwargs)
    while True:
        for out in engine.step():
            if out.new_token_ids:
                return time.perf_counter() - t, out.new_token_ids[0]


async def bench_ttft(reps: int) -> dict:
    """TTFT of a prompt whose 2,000-token prefix is computed vs. fetched from the KV cache
    (a fresh engine each time, so its own prefix cache never helps)."""
    from tokenyard.engine.config import EngineConfig
    from tokenyard.engine.llm_engine import LLMEngine
    from tokenyard.kv.store.client import KVCacheClient
    from tokenyard.kv.store.engine_bridge import fetch_prefix, offload_prefix
    from tokenyard.models.loader import load_model
    from tokenyard.services.kvcache.server import serve
    from tokenyard.services.kvcache.settings import KVCacheSettings

    loaded = load_model()
    vocab = loaded.config.vocab_size

    def new_engine() -> LLMEngine:
        engine = LLMEngine(EngineConfig(kv_cache_bytes=160 * LAYOUT.block_nbytes), loaded=loaded)
        first_token_seconds(
            engine, "warm-up", [1, 2, 3]
        )  # first-call costs stay out of the figures
        engine.abort("warm-up")
        return engine

    prompt = [(i * 7919) % (vocab - 200) + 100 for i in range(PROMPT_TOKENS + 16)]
    server = await serve(KVCacheSettings(port=0, ram_bytes=1 << 30, shutdown_grace_s=0))
    try:
        async with KVCacheClient(server.endpoint, timeout_s=60) as cache:
            prefill = new_engine()
            recompute, token = first_token_seconds(prefill, "p", prompt, prefill_only=True)
            await offload_prefix(prefill, cache, "p")
            hits = []
            for i in range(reps):
                engine = new_engine()
                t = time.perf_counter()
                cached = await fetch_prefix(engine, cache, prompt)
                fetch = time.perf_counter() - t
                ttft, hit_token = first_token_seconds(engine, f"h{i}", prompt)
                engine.abort(f"h{i}")
                assert cached >= PROMPT_TOKENS and hit_token == token, (cached, hit_token, token)
                hits.append({"fetch_s": fetch, "ttft_s": fetch + ttft})
    finally:
        await server.stop()
    median_hit = statistics.median(h["ttft_s"] for h in hits)
    return {
        "prompt_tokens": len(prompt),
        "cached_prefix_tokens": cached,
        "recompute_ttft_s": recompute,
        "kv_cache_hit_ttft_s": median_hit,
        "hits": hits,
        "speedup": recompute / median_hit,
        "same_first_token": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--no-ttft", action="store_true", help="skip the engine TTFT part")
    parser.add_argument("--ttft-reps", type=int, default=3)
    args = parser.parse_args()
    results = asyncio.run(run(args.reps))
    if not args.no_ttft:
        results["ttft"] = asyncio.run(bench_ttft(args.ttft_reps))
    report = {
        "layout": LAYOUT.__dict__,
        "prompt_tokens": PROMPT_TOKENS,
        "blocks": NUM_BLOCKS,
        "bytes": NUM_BLOCKS * LAYOUT.block_nbytes,
        "reps": args.reps,
        "machine": {
            "cpus": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "mooncake_protocol": "tcp",
        **results,
        "targets": {"shm_fraction_of_memcpy": 0.5, "grpc_gbps": 0.8, "ttft_speedup": 3.0},
    }
    args.out = out_path(args.out, "kv_transfer")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, gbps in results["gbps"].items():
        fraction = results["fraction_of_memcpy"].get(name)
        note = f"  ({fraction:.0%} of the memcpy timed beside it)" if fraction is not None else ""
        print(f"{name:>18}: {gbps:6.2f} GB/s{note}")
    if "ttft" in results:
        t = results["ttft"]
        print(
            f"TTFT {t['prompt_tokens']} tokens: recompute {t['recompute_ttft_s']:.2f} s, "
            f"KV-cache hit {t['kv_cache_hit_ttft_s']:.2f} s ({t['speedup']:.1f}x)"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
