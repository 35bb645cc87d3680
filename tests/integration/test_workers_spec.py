"""Speculative decoding in the workers: `TOKENYARD_WORKER_SPECULATIVE` (what `tokenyard up
--speculative` sets) on a real prefill -> decode hand-off over a real nats-server gives the
offline engine's greedy tokens exactly, with drafts kept and counted on /metrics."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from worker_client import Heartbeats, Request, connect, wait_disaggregated

from tokenyard.services.launch.procs import wait_until
from tokenyard.services.launch.stack import StackConfig
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

# Copy-heavy: the answer repeats the prompt, so prompt lookup drafts well.
PROMPT = "Repeat: " + "red cup, blue cup, green cup, " * 8
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def stack(launch_stack):
    config = StackConfig(
        gateway=False,
        kvcache=False,
        facilities=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        worker_env={
            "TOKENYARD_WORKER_KV_CACHE_BYTES": str(64 << 20),
            "TOKENYARD_WORKER_SPECULATIVE": '{"method": "ngram", "num_speculative_tokens": 4}',
        },
    )
    with launch_stack(config) as s:
        yield s


def accepted_tokens(stack) -> float:
    text = httpx.get(f"{stack.ops_urls['decode-2']}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenyard:spec_decode_num_accepted_tokens_total"
    )


async def test_speculating_decode_worker_gives_the_offline_greedy_tokens(stack):
    from tokenyard import LLM, SamplingParams

    llm = LLM(kv_cache_bytes=64 << 20)
    prompt = llm.tokenizer.encode(PROMPT)
    want = llm.generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0].token_ids
    bus = await connect(stack.nats_url)
    beats = await Heartbeats().start(bus)
    assert await beats.wait_for(lambda b: len(b) >= 2, 240), stack.describe_failures()
    await wait_disaggregated(bus, prompt)
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True)
    req = Request(bus, prompt, params)
    assert (await req.submit()).placement.disaggregated
    result = await req.wait(120)
    await bus.close()
    assert result.token_ids == want
    assert result.last.worker_id == "decode-2" and result.last.finish_reason == "length"
    # Kept drafts: fewer streamed steps than tokens, and the counter on the decode worker.
    assert len(result.chunks) < len(result.token_ids)
    assert wait_until(lambda: accepted_tokens(stack) > 0, 10)
