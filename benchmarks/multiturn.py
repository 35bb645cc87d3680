"""Prompt caching across turns: multi-turn chat on two workers, with and without the
shared KV tier, and under round-robin placement.

    .venv/bin/python benchmarks/multiturn.py [--conversations 16] [--turns 4-8] \
        [--think-s 2] [--kv-cache-mib 24] \
        [--configs offload-on,offload-off,round-robin,vllm-cpu] \
        [--vllm-python PEERS/vllm/bin/python] [--out multiturn.json]

Each conversation (``--turns`` user turns: a number, or a range ``A-B`` drawn per
conversation) shares one system prompt, then sends its user turns one by one, each
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
- ``round-robin``: the shared tier as in ``offload-on``, placement blind to any cache;
- ``vllm-cpu``: vLLM's CPU server (``--vllm-python``) with prefix caching, one server on the
  stack's two threads and its own KV space (benchmarks/peers.py starts it; 1 GiB, which holds
  every conversation: its cache never cycles).

The configurations run one after the other, each loaded by the same client with the same
conversations; the load average before and after each is kept, since a shared host's speed
drifts. A PNG chart (TTFT p50 by turn index, hit rate, throughput) goes beside the JSON.

Reported per configuration: TTFT p50/p99 per turn index, turns 2+ together, the share of
prompt tokens served from cache (the usage's cached_tokens; vLLM reports it too) and, from the workers'
metrics, by tier (local prefix cache or shared service), output tokens per second, and
the bytes moved to and from the KV-cache service. The JSON goes outside the repo unless
``--out`` says where (benchmarks/result_path.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from peers import Model, Running, chosen_model, convert_for_vllm, start_tokenyard, start_vllm
from result_path import OUT_HELP, out_path

from tokenyard.bench.client import Target, stream_request
from tokenyard.bench.text import text_of_tokens
from tokenyard.engine.config import auto_dtype
from tokenyard.stats import percentile

CONFIGS = {
    "offload-on": ["--router-placement", "kv-aware"],
    "offload-off": ["--router-placement", "kv-aware", "--no-kvcache"],
    "round-robin": ["--router-placement", "round-robin"],
    "vllm-cpu": ["--enable-prefix-caching"],  # vLLM's flags, not ours
}
VLLM = "vllm-cpu"
LOCAL_ARGS = ("out", "log_dir", "vllm_python", "vllm_model_dir")
# Series of the workers' metrics (re-exposed on the gateway's /metrics) worth keeping.
SERIES = (
    "tokenyard:kv_hit_tokens_total",
    "tokenyard:prompt_tokens_total",
    "tokenyard:kv_offload_bytes_total",
    "tokenyard:kv_offload_dropped_bytes_total",
    "tokenyard:kv_fetch_bytes_total",
)


def turn_range(text: str) -> tuple[int, int]:
    """``--turns``: "4" or "4-8"."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--turns {text}: want N or A-B with 1 <= A <= B")
    return bounds


def conversations(args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    rng = random.Random(args.seed)
    system = "You are a patient assistant. " + text_of_tokens(rng, args.system_len)
    turns = [
        [text_of_tokens(rng, args.user_len) for _ in range(rng.randint(*args.turns))]
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


def start(name: str, args: argparse.Namespace, model: Model, work: Path) -> Running:
    """One configuration's server, answering."""
    logs = (args.log_dir or work) / name
    if name == VLLM:
        if not args.vllm_python:
            raise SystemExit(f"{VLLM} needs --vllm-python")
        folder = model.folder or convert_for_vllm(model.gguf, args.vllm_model_dir or work / "vllm")
        logs.mkdir(parents=True, exist_ok=True)
        dtype = args.vllm_dtype or auto_dtype("cpu")
        return start_vllm(args.vllm_python, folder, logs / "vllm.log", dtype, model, CONFIGS[name])
    flags = ["--workers", str(args.workers), "--kv-cache-mib", str(args.kv_cache_mib)]
    flags += ["--no-facilities", *CONFIGS[name]]
    return start_tokenyard(flags, logs / "logs", model, args.start_timeout_s)


def run_config(name: str, args: argparse.Namespace, model: Model, work: Path) -> dict[str, Any]:
    print(f"{name}: starting", flush=True)
    load_before = os.getloadavg()
    running = start(name, args, model, work)
    try:
        result = asyncio.run(load(running.url, model.name, args))
    finally:
        running.stop()
    result["load_avg"] = {"before": load_before, "after": os.getloadavg()}
    later = result["ttft_ms_turns_2_plus"]
    print(
        f"{name}: TTFT turns 2+ p50 {later['p50']} ms p99 {later['p99']} ms, "
        f"hit rate {result['hit_rate']}, {result['output_tok_s']} tok/s, "
        f"{result['failed']} failed",
        flush=True,
    )
    return result


def targets(results: dict[str, Any]) -> dict[str, float | None]:
    """Turns 2+ TTFT p50 of offload-on over each baseline's (the issue's target: <= 0.5)."""
    ours = results.get("offload-on", {}).get("ttft_ms_turns_2_plus", {}).get("p50")
    out: dict[str, float | None] = {}
    for other in ("offload-off", VLLM):
        theirs = results.get(other, {}).get("ttft_ms_turns_2_plus", {}).get("p50")
        out[f"offload-on / {other}"] = round(ours / theirs, 3) if ours and theirs else None
    return out


def chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for i, name in enumerate(names):
        by_turn = results[name]["ttft_ms_by_turn"]
        turns = sorted(by_turn, key=int)
        axes[0].plot(
            [int(t) for t in turns],
            [by_turn[t]["p50"] for t in turns],
            "o-",
            label=name,
            color=f"C{i}",
        )
    axes[0].set_xlabel("turn")
    axes[0].set_title("TTFT p50 by turn, ms (lower is better)")
    axes[0].legend(fontsize="small")
    colors = [f"C{i}" for i in range(len(names))]
    hits = [results[n]["hit_rate_turns_2_plus"] or 0 for n in names]
    axes[1].bar(range(len(names)), hits, color=colors)
    axes[1].set_title("prompt tokens served from cache, turns 2+")
    axes[2].bar(range(len(names)), [results[n]["output_tok_s"] for n in names], color=colors)
    axes[2].set_title("output tokens/s (higher is better)")
    for ax in axes[1:]:
        ax.set_xticks(range(len(names)), names, rotation=15, fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=turn_range, default=(4, 8), help="N or A-B (default 4-8)")
    parser.add_argument("--system-len", type=int, default=192)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--reply-len", type=int, default=32)
    parser.add_argument("--think-s", type=float, default=2.0)
    parser.add_argument("--stagger-s", type=float, default=0.5)
    parser.add_argument("--kv-cache-mib", type=int, default=24, help="each worker's KV pool")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--configs", default="offload-on,offload-off,round-robin")
    parser.add_argument("--vllm-python", help="a Python with vllm-cpu installed (for vllm-cpu)")
    parser.add_argument("--vllm-model-dir", type=Path, help="where the converted model goes")
    parser.add_argument("--vllm-dtype", help="vLLM's --dtype (default: what ours computes in)")
    parser.add_argument(
        "--start-timeout-s", type=float, default=900, help="for a stack to answer (a loaded host)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help=OUT_HELP)
    parser.add_argument("--log-dir", type=Path, help="keep the servers' logs here")
    args = parser.parse_args()
    names = args.configs.split(",")
    if unknown := set(names) - set(CONFIGS):
        parser.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    model: Model = chosen_model(None, None)
    out = out_path(args.out, "multiturn")
    doc: dict[str, Any] = {
        "model": model.name,
        # Not the paths: the file may be cited from the repo, which names no machine's paths.
        "args": {k: v for k, v in vars(args).items() if k not in LOCAL_ARGS},
        "cpus": os.cpu_count(),
        "results": {},
    }
    with tempfile.TemporaryDirectory(prefix="tokenyard-multiturn-") as tmp:
        for name in names:
            doc["results"][name] = run_config(name, args, model, Path(tmp))
            doc["targets"] = targets(doc["results"])
            out.write_text(json.dumps(doc, indent=2) + "\n")
    chart(doc, out.with_suffix(".png"))
    print(f"targets (<= 0.5 wanted): {doc['targets']}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
