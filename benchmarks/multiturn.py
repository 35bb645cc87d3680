"""Prompt caching across turns: multi-turn chat on two workers, with and without the
shared KV tier, and under round-robin placement.

    .venv/bin/python benchmarks/multiturn.py [--conversations 16] [--turns 4] \
        [--think-s 2] [--kv-cache-mib 24] [--configs offload-on,offload-off,round-robin] \
        [--out multiturn.json]

Each conversation shares one system prompt, then sends its user turns one by one, each
after the previous reply arrived plus a think time (exponential, mean ``--think-s``); every
turn resends the whole history with the server's real replies in it. Conversations start
``--stagger-s`` apart. The workers' KV pools (``--kv-cache-mib``) hold a few conversations
each, far fewer than are under way, so a worker's own cache has moved on by a
conversation's next turn: only the shared tier still holds it.

Configurations (each a fresh `tokenyard up --workers 2`):

- ``offload-on``: KV-aware placement; the KV-cache service keeps every turn's prompt and
  reply blocks, and the router weighs a fetch from it against a local hit;
- ``offload-off``: KV-aware placement, no KV-cache service (`--no-kvcache`): the workers'
  own prefix caches only;
- ``round-robin``: the shared tier as in ``offload-on``, placement blind to any cache.

Reported per configuration: TTFT p50/p99 per turn index, turns 2+ together, the share of
prompt tokens served from cache (the usage's cached_tokens) and, from the workers'
metrics, by tier (local prefix cache or shared service), output tokens per second, and
the bytes moved to and from the KV-cache service. The JSON goes outside the repo unless
``--out`` says where (benchmarks/result_path.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from peers import Model, chosen_model, start_tokenyard
from result_path import OUT_HELP, out_path

from tokenyard.bench.client import Target, stream_request
from tokenyard.bench.text import text_of_tokens
from tokenyard.stats import percentile

CONFIGS = {
    "offload-on": ["--router-placement", "kv-aware"],
    "offload-off": ["--router-placement", "kv-aware", "--no-kvcache"],
    "round-robin": ["--router-placement", "round-robin"],
}
# Series of the workers' metrics (re-exposed on the gateway's /metrics) worth keeping.
SERIES = (
    "tokenyard:kv_hit_tokens_total",
    "tokenyard:prompt_tokens_total",
    "tokenyard:kv_offload_bytes_total",
    "tokenyard:kv_offload_dropped_bytes_total",
    "tokenyard:kv_fetch_bytes_total",
)


def conversations(args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    rng = random.Random(args.seed)
    system = "You are a patient assistant. " + text_of_tokens(rng, args.system_len)
    turns = [
        [text_of_tokens(rng, args.user_len) for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    return system, turns


async def converse(
    client: httpx.AsyncClient,
    target: Target,
    system: str,
    users: list[str],
    args: argparse.Namespace,
    rng: random.Random,
    records: list[dict[str, Any]],
) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for index, user in enumerate(users):
        if index:
            await asyncio.sleep(rng.expovariate(1.0 / args.think_s) if args.think_s else 0)
        messages.append({"role": "user", "content": user})
        ex = await stream_request(client, target, list(messages), args.reply_len)
        usage = ex.usage or {}
        details: Any = usage.get("prompt_tokens_details") or {}
        records.append(
            {
                "turn": index + 1,
                "ok": ex.ok,
                "error": ex.error,
                "ttft_ms": (ex.chunk_ns[0] - ex.start_ns) / 1e6 if ex.chunk_ns else None,
                "e2e_ms": (ex.end_ns - ex.start_ns) / 1e6,
                "prompt_tokens": usage.get("prompt_tokens", 0),
                "cached_tokens": details.get("cached_tokens", 0) if details else 0,
                "output_tokens": usage.get("completion_tokens", 0),
            }
        )
        if not ex.ok:
            return
        messages.append({"role": "assistant", "content": ex.output_text})


async def load(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    system, all_turns = conversations(args)
    target = Target(url, model, ignore_eos=True, timeout_s=600)
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        started = time.monotonic()

        async def one(i: int, users: list[str]) -> None:
            await asyncio.sleep(i * args.stagger_s)
            rng = random.Random(args.seed * 1000 + i)
            await converse(client, target, system, users, args, rng, records)

        async with asyncio.TaskGroup() as tg:
            for i, users in enumerate(all_turns):
                tg.create_task(one(i, users))
        elapsed = time.monotonic() - started
        metrics = await scrape(client, url)
    return summarize(records, elapsed, metrics)


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The fleet's series in SERIES, summed over workers, by their other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await client.get(url.rstrip("/") + "/metrics")).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in SERIES:
                continue
            extra = {k: v for k, v in sample.labels.items() if k in ("tier", "source")}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    return {
        "p50": round(percentile(values, 50), 1),
        "p99": round(percentile(values, 99), 1),
        "n": len(values),
    }


def summarize(
    records: list[dict[str, Any]], elapsed: float, metrics: dict[str, float]
) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    by_turn: dict[str, Any] = {}
    for turn in sorted({r["turn"] for r in ok}):
        by_turn[str(turn)] = _pcts([r["ttft_ms"] for r in ok if r["turn"] == turn])
    prompt = sum(r["prompt_tokens"] for r in ok)
    later = [r for r in ok if r["turn"] > 1]
    prompt_later = sum(r["prompt_tokens"] for r in later)
    prefilled = metrics.get("tokenyard:prompt_tokens_total", 0.0)
    tiers = {
        tier: metrics.get(f"tokenyard:kv_hit_tokens_total{{tier={tier}}}", 0.0)
        for tier in ("local", "shared")
    }
    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({str(r["error"])[:120] for r in records if not r["ok"]})[:5],
        "elapsed_s": round(elapsed, 1),
        "output_tok_s": round(sum(r["output_tokens"] for r in ok) / elapsed, 2),
        "ttft_ms_by_turn": by_turn,
        "ttft_ms_turns_2_plus": _pcts([r["ttft_ms"] for r in later]),
        "hit_rate": round(sum(r["cached_tokens"] for r in ok) / prompt, 3) if prompt else None,
        "hit_rate_turns_2_plus": (
            round(sum(r["cached_tokens"] for r in later) / prompt_later, 3)
            if prompt_later
            else None
        ),
        "hit_rate_by_tier": {
            t: round(v / prefilled, 3) if prefilled else None for t, v in tiers.items()
        },
        "metrics": metrics,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=192)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--reply-len", type=int, default=32)
    parser.add_argument("--think-s", type=float, default=2.0)
    parser.add_argument("--stagger-s", type=float, default=0.5)
    parser.add_argument("--kv-cache-mib", type=int, default=24, help="each worker's KV pool")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--log-dir", type=Path, help="keep the stacks' logs here")
    args = parser.parse_args()
    model: Model = chosen_model(None, None)
    out = out_path(args.out, "multiturn")
    doc: dict[str, Any] = {
        "model": model.name,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    doc["results"] = {}
    with tempfile.TemporaryDirectory(prefix="tokenyard-multiturn-") as tmp:
        for name in args.configs.split(","):
            flags = [
                "--workers",
                str(args.workers),
                "--kv-cache-mib",
                str(args.kv_cache_mib),
                "--no-facilities",
                *CONFIGS[name],
            ]
            print(f"{name}: starting", flush=True)
            logs = (args.log_dir or Path(tmp)) / name / "logs"
            running = start_tokenyard(flags, logs, model)
            try:
                result = asyncio.run(load(running.url, model.name, args))
            finally:
                running.stop()
            doc["results"][name] = result
            out.write_text(json.dumps(doc, indent=2))
            later = result["ttft_ms_turns_2_plus"]
            print(
                f"{name}: TTFT turns 2+ p50 {later['p50']} ms p99 {later['p99']} ms, "
                f"hit rate {result['hit_rate']}, {result['output_tok_s']} tok/s, "
                f"{result['failed']} failed",
                flush=True,
            )
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
