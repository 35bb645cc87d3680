"""Chaos: while 16 streams run, kill -9 one service at a time (a decode worker, the prefill
worker, the router, the KV-cache service, nats-server) under the launcher's supervisor.

Every accepted request must end in a full answer or a clear error (an OpenAI error body or
a final error event; never a hang or a cut stream), at least 95% in a full answer, and the
stack must serve again afterwards with nobody touching it. The counts go to the test's
output and to $TOKENYARD_CHAOS_REPORT (JSON) when set.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.stack import LocalStack, StackConfig

pytestmark = pytest.mark.slow

STREAMS = 16
MAX_TOKENS = 24
KILL_AFTER_S = 2.0
VICTIMS = ["decode-3", "prefill-1", "router", "kvcache", "nats"]
STREAM_TIMEOUT_S = 180.0


ERRORS: list[str] = []  # the error events' messages, for the report when the test fails
BROKEN: list[str] = []  # what each broken stream saw last, for the report


async def one_stream(client: httpx.AsyncClient, model: str, i: int) -> str:
    """'full', 'error' (a clear OpenAI error), 'refused' (not accepted: 4xx/5xx at once),
    or 'broken' (anything else: a cut stream, no finish, a hang)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 30}, one per line."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }
    last = ""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = json.loads(await r.aread())["error"]
                return "refused" if error.get("message") else "broken"
            finish = None
            async for line in r.aiter_lines():
                last = line or last
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    ERRORS.append(str(event["error"].get("message")))
                    return "error"
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
            if finish in ("stop", "length"):
                return "full"
            BROKEN.append(f"no finish; last line {last[:300]}")
            return "broken"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        BROKEN.append(f"{type(exc).__name__}: {exc}; last line {last[:300]}")
        return "broken"


async def supervise(stack: LocalStack, stop: asyncio.Event) -> None:
    while not stop.is_set():
        stack.supervise()
        await asyncio.sleep(0.2)


async def serves_again(client: httpx.AsyncClient, model: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await one_stream(client, model, 0) == "full":
            return time.monotonic() - t0
        await asyncio.sleep(0.5)
    raise AssertionError(f"the stack did not serve again within {timeout:.0f} s")


async def round_with_kill(stack: LocalStack, client: httpx.AsyncClient, victim: str) -> Counter:
    streams = [asyncio.create_task(one_stream(client, stack.model_id, i)) for i in range(STREAMS)]
    await asyncio.sleep(KILL_AFTER_S)
    next(p for p in stack.procs if p.name == victim).kill()
    done = await asyncio.wait_for(asyncio.gather(*streams), STREAM_TIMEOUT_S)
    return Counter(done)


@pytest.fixture
def stack(tmp_path: Path):
    config = StackConfig(
        port=free_port(),
        prefill=1,
        decode=2,
        facilities=False,
        log_dir=tmp_path,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env={"TOKENYARD_WORKER_KV_CACHE_BYTES": str(128 << 20)},
    )
    with LocalStack(config) as s:
        s.wait_ready(timeout=300)
        yield s


async def test_sixteen_streams_survive_one_kill_at_a_time(stack: LocalStack):
    report: dict[str, dict] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(supervise(stack, stop))
    timeout = httpx.Timeout(STREAM_TIMEOUT_S, connect=10)
    try:
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=timeout) as client:
            for victim in VICTIMS:
                counts = await round_with_kill(stack, client, victim)
                recovered_s = await serves_again(client, stack.model_id, 90)
                report[victim] = {**counts, "serves_again_after_s": round(recovered_s, 1)}
    finally:
        stop.set()
        await watcher
    total = sum(
        (
            Counter({k: v for k, v in r.items() if k != "serves_again_after_s"})
            for r in report.values()
        ),
        Counter(),
    )
    report["total"] = dict(total)
    report["error_messages"] = sorted(set(ERRORS))
    report["broken_streams"] = BROKEN
    print(json.dumps(report, indent=1))
    if path := os.environ.get("TOKENYARD_CHAOS_REPORT"):
        Path(path).write_text(json.dumps(report, indent=1))
    accepted = total["full"] + total["error"] + total["broken"]
    assert total["broken"] == 0, report
    assert total["full"] >= 0.95 * accepted, report
    restarts = {n: r.restarts for n, r in stack.supervisor.records.items() if r.restarts}
    assert set(restarts) == set(VICTIMS), restarts
