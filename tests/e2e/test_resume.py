"""A decode worker killed mid-stream: the gateway resumes the request on the other decode
worker from the tokens already streamed, and the client gets the whole greedy answer.

Real processes (NATS, router, one prefill and two decode workers on the real engine); the
gateway's NATS backend runs in the test so the chunks' token ids can be checked exactly.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenyard.bus.embedded import free_port
from tokenyard.services.gateway.backend import NatsBackend
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.launch.stack import LocalStack, StackConfig
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a lighthouse keeper and a storm. " * 3
MAX_TOKENS = 48
KILL_AFTER = 6  # tokens streamed before the decode worker is killed
KV_BYTES = 128 << 20


@pytest.fixture(scope="module")
def stack(launch_stack):
    config = StackConfig(
        port=free_port(),
        decode=2,
        gateway=False,
        kvcache=False,
        facilities=False,
        telemetry=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env={"TOKENYARD_WORKER_KV_CACHE_BYTES": str(KV_BYTES)},
    )
    with launch_stack(config) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    from tokenyard import LLM, SamplingParams

    llm = LLM(kv_cache_bytes=KV_BYTES)
    prompt = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return prompt, llm.generate([prompt], params)[0].token_ids


async def wait_live(backend: NatsBackend, stack: LocalStack, timeout: float = 300) -> None:
    want = {p.name for p in stack.workers}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = {w.worker_id for w in backend.fleet.live(time.monotonic())}
        if want <= live:
            await asyncio.sleep(2)  # the router hears the same heartbeats; let it catch up
            return
        stack.check_alive()
        await asyncio.sleep(0.25)
    raise TimeoutError(f"workers not live\n{stack.describe_failures()}")


async def test_killed_decode_worker_is_resumed_elsewhere(stack, offline):
    prompt, want = offline
    backend = NatsBackend(GatewaySettings(nats_url=stack.nats_url, dead_worker_grace_s=2))
    await backend.start()
    try:
        await wait_live(backend, stack)
        params = pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True
        )
        stream = await backend.submit("resume-1", "", prompt, params)
        tokens: list[int] = []
        senders: list[str] = []
        killed = ""
        started = time.monotonic()
        async with asyncio.timeout(180):
            async for chunk in stream:
                tokens += chunk.token_ids
                senders.append(chunk.worker_id)
                if (
                    not killed
                    and len(tokens) >= KILL_AFTER
                    and chunk.worker_id.startswith("decode")
                ):
                    killed = chunk.worker_id
                    next(p for p in stack.workers if p.name == killed).kill()
                    killed_at = time.monotonic()
        await stream.close()
        assert killed, f"no decode worker streamed (senders {senders})"
        assert tokens == want
        after = senders[senders.index(killed) :]
        others = {s for s in after if s != killed}
        assert others and all(s.startswith("decode") for s in others), senders
        print(
            f"resumed: {time.monotonic() - killed_at:.1f} s from the kill to the end, "
            f"{time.monotonic() - started:.1f} s in all"
        )
    finally:
        await backend.stop()
