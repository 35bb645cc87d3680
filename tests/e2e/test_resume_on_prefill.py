"""The only decode worker killed mid-stream: the gateway resumes the request on the prefill
worker (no decode worker is left), and the client still gets the whole greedy answer.

Real processes (NATS, router, one prefill and one decode worker on the real engine); the
gateway's NATS backend runs in the test so the chunks' token ids can be checked exactly.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_resume import KILL_AFTER, KV_BYTES, MAX_TOKENS, wait_live

from tokenyard.bus.embedded import free_port
from tokenyard.services.gateway.backend import NatsBackend
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.launch.stack import StackConfig
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

PROMPT = "Tell me about the tides, the moon and the lighthouse on the cape. " * 3


@pytest.fixture(scope="module")
def stack(launch_stack):
    config = StackConfig(
        port=free_port(),
        prefill=1,
        decode=1,
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


async def test_the_prefill_worker_resumes_when_the_only_decode_worker_dies(stack, offline):
    prompt, want = offline
    backend = NatsBackend(GatewaySettings(nats_url=stack.nats_url, dead_worker_grace_s=2))
    await backend.start()
    try:
        await wait_live(backend, stack)
        params = pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True
        )
        stream = await backend.submit("resume-on-prefill", "", prompt, params)
        tokens: list[int] = []
        senders: list[str] = []
        killed = ""
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
                    next(p for p in stack.workers if p.name == killed).kill()  # kill -9
                    killed_at = time.monotonic()
        await stream.close()
        assert killed, f"no decode worker streamed (senders {senders})"
        assert tokens == want
        after = senders[senders.index(killed) :]
        takers = {s for s in after if s != killed}
        assert takers == {"prefill-1"}, senders
        print(f"resumed on the prefill worker: {time.monotonic() - killed_at:.1f} s to the end")
    finally:
        await backend.stop()
