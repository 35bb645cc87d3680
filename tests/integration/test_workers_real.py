"""Prefill and decode workers with the real engine over a real nats-server.

The disaggregated path (prefill worker -> KV pull -> decode worker) must give the offline
engine's greedy tokens exactly; a cancel mid-decode must give every block back.
"""

from __future__ import annotations

import re

import pytest
from worker_client import Heartbeats, Request, connect, wait_disaggregated

from tokenyard.services.launch.stack import StackConfig
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. " * 6,  # several full blocks: a real KV pull
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(launch_stack):
    config = StackConfig(
        gateway=False,
        kvcache=False,
        facilities=False,
        telemetry=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env={"TOKENYARD_WORKER_KV_CACHE_BYTES": str(128 << 20)},
    )
    with launch_stack(config) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    from tokenyard import LLM, SamplingParams

    llm = LLM(kv_cache_bytes=128 << 20)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    results = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    return prompts, [r.token_ids for r in results]


async def test_disaggregated_greedy_equals_offline(stack, offline):
    prompts, want = offline
    bus = await connect(stack.nats_url)
    beats = await Heartbeats().start(bus)
    assert await beats.wait_for(lambda b: len(b) >= 2, 240), stack.describe_failures()
    await wait_disaggregated(bus, prompts[0])
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True)
    for prompt, tokens in zip(prompts, want, strict=True):
        req = Request(bus, prompt, params)
        reply = await req.submit()
        assert reply.placement.disaggregated
        result = await req.wait(120)
        assert result.token_ids == tokens
        assert result.chunks[0].worker_id == "prefill-1" and result.last.worker_id == "decode-2"
        assert result.last.finish_reason == "length"
    await bus.close()
    # The long prompt's KV came over the transfer layer (with the decode pool's own gRPC
    # token, from an endpoint the prefill worker's heartbeats advertise), not by recomputing.
    log = (stack.log_dir / "decode-2.log").read_text()
    assert re.search(r"KV pull \S+: \d+ blocks", log), log[-2000:]
    assert not re.search(r"KV pull .* failed", log) and "no live worker advertises" not in log


async def test_cancel_mid_decode_frees_every_block(stack, offline):
    prompts, _ = offline
    bus = await connect(stack.nats_url)
    beats = await Heartbeats().start(bus)
    assert await beats.wait_for(lambda b: len(b) >= 2, 240)
    req = Request(
        bus,
        prompts[1],
        pb.SamplingParams(max_tokens=2000, temperature=0.0, top_p=1.0, ignore_eos=True),
    )
    await req.submit()
    await req.first_chunk.wait()
    assert await beats.wait_for(lambda b: b["decode-2"].num_running == 1, 30)
    await req.cancel()
    result = await req.wait(30)
    assert result.last.finish_reason == "abort" and len(result.token_ids) < 2000
    assert await beats.wait_for(
        lambda b: all(h.num_free_blocks == h.num_blocks and h.num_running == 0 for h in b.values()),
        15,
    )
    await bus.close()
