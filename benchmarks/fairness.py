"""Fair queueing and priority on the stack: a quiet tenant beside a noisy one at saturation.

    .venv/bin/python benchmarks/fairness.py [--max-num-seqs 4] [--noisy 10] [--quiet-requests 16] \
        [--out fairness.json]

Starts one aggregated worker (real model, `max_num_seqs` slots) behind a gateway with three
static API keys, each its own tenant, and measures streamed TTFT from the client:

- alone: the quiet tenant only, one request at a time;
- fair / fcfs: the noisy tenant keeps `--noisy` requests in flight (ten times the quiet
  tenant's one), which saturates the worker, while the quiet tenant sends the same requests
  as alone; once with the worker's scheduling policy "fair", once with "fcfs" (fairness
  off); in both, a third tenant sends a `priority: -10` request now and then.

Reports the quiet tenant's TTFT p50/p99 per case, fair and fcfs p99 over alone, and the
urgent requests' TTFT beside the quiet tenant's under the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from result_path import OUT_HELP, out_path

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.stats import percentile

KEYS = {"noisy": "sk-bench-noisy", "quiet": "sk-bench-quiet", "urgent": "sk-bench-urgent"}
_serial = itertools.count()
PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(6))


async def ttft(client: httpx.AsyncClient, key: str, max_tokens: int, priority: int = 0) -> float:
    """Seconds from sending a streamed completion to its first token; it then runs to its end."""
    body = {
        "model": client.headers["x-model"],
        "prompt": f"{next(_serial)} {PROMPT}",  # each its own: no prefix-cache hit
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "priority": priority,
    }
    started = time.perf_counter()
    first: float | None = None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    assert first is not None
    return first


async def noisy_load(client: httpx.AsyncClient, streams: int, max_tokens: int, stop: asyncio.Event):
    async def one_stream() -> None:
        while not stop.is_set():
            await ttft(client, KEYS["noisy"], max_tokens)

    await asyncio.gather(*(one_stream() for _ in range(streams)))


async def quiet_and_urgent(
    client: httpx.AsyncClient, args: argparse.Namespace, *, urgent: bool
) -> dict[str, list[float]]:
    quiet: list[float] = []
    urgents: list[float] = []
    for i in range(args.quiet_requests):
        quiet.append(await ttft(client, KEYS["quiet"], args.max_tokens))
        if urgent and i % 2 == 1:
            urgents.append(await ttft(client, KEYS["urgent"], args.max_tokens, priority=-10))
    return {"quiet": quiet, "urgent": urgents}


async def run_case(gateway_url: str, args: argparse.Namespace, *, noisy: bool) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {KEYS['quiet']}"}
    models = httpx.get(f"{gateway_url}/v1/models", headers=auth, timeout=10)
    model = models.json()["data"][0]["id"]
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=gateway_url, timeout=timeout) as client:
        client.headers["x-model"] = model  # what every request names
        stop = asyncio.Event()
        load = None
        if noisy:
            load = asyncio.create_task(noisy_load(client, args.noisy, args.max_tokens, stop))
            await asyncio.sleep(args.warmup_s)  # let the noisy tenant fill the worker
        try:
            ttfts = await quiet_and_urgent(client, args, urgent=noisy)
        finally:
            stop.set()
            if load is not None:
                await load
    return {name: summary(values) for name, values in ttfts.items() if values}


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "ttft_p50_s": round(percentile(values, 50), 4),
        "ttft_p99_s": round(percentile(values, 99), 4),
        "ttft_s": [round(v, 4) for v in values],
    }


def start_stack(policy: str, args: argparse.Namespace, logs: Path) -> LocalStack:
    config = StackConfig(
        port=free_port(),
        aggregated=True,
        workers=1,
        kvcache=False,
        facilities=False,
        telemetry=False,
        log_dir=logs,
        gateway_env={"TOKENYARD_GATEWAY_API_KEYS": ",".join(KEYS.values())},
        worker_env={
            "TOKENYARD_WORKER_MAX_NUM_SEQS": str(args.max_num_seqs),
            "TOKENYARD_WORKER_SCHEDULING_POLICY": policy,
        },
    )
    stack = LocalStack(config).start()
    wait_ready(stack, timeout=600)
    return stack


def wait_ready(stack: LocalStack, timeout: float) -> None:
    """LocalStack.wait_ready, but its /v1/models asks for a key here: the caller fetches it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.check_alive()
        body = stack.ready()
        if body is not None and stack.all_workers_registered(body):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the stack was not ready after {timeout:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--noisy", type=int, default=10, help="the noisy tenant's streams")
    parser.add_argument("--quiet-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    args = parser.parse_args()
    out = out_path(args.out, "fairness")
    doc: dict[str, Any] = {"settings": vars(args) | {"out": str(out)}, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="tokenyard-fairness-") as tmp:
        for policy, cases in (("fair", ("alone", "fair")), ("fcfs", ("fcfs",))):
            stack = start_stack(policy, args, Path(tmp) / policy)
            try:
                for case in cases:
                    noisy = case != "alone"
                    doc["cases"][case] = asyncio.run(run_case(stack.gateway_url, args, noisy=noisy))
                    out.write_text(json.dumps(doc, indent=2))
                    print(
                        case,
                        json.dumps({k: v["ttft_p99_s"] for k, v in doc["cases"][case].items()}),
                    )
            finally:
                stack.stop()
    alone = doc["cases"]["alone"]["quiet"]["ttft_p99_s"]
    doc["quiet_p99_over_alone"] = {
        case: round(doc["cases"][case]["quiet"]["ttft_p99_s"] / alone, 2)
        for case in ("fair", "fcfs")
    }
    out.write_text(json.dumps(doc, indent=2))
    print("quiet TTFT p99 over alone:", doc["quiet_p99_over_alone"])
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
