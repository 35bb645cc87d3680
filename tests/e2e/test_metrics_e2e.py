"""Worker metrics on a real stack equal what happened: the tokens counted on the workers'
/metrics are the usage the client received, and a repeated prompt moves the prefix-cache
hit counter. Uses the suite's `stack` (1 prefill + 1 decode worker, disaggregated)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenyard.services.launch.procs import wait_until

pytestmark = pytest.mark.slow

# Long enough for several full 16-token KV blocks.
PROMPT = " ".join(f"item {i} is a blue stone on the shelf;" for i in range(12))


def fleet_total(stack, name: str) -> float:
    """The sum of one metric's samples over every worker's /metrics."""
    total = 0.0
    for worker in stack.workers:
        text = httpx.get(f"{stack.ops_urls[worker.name]}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples if s.name == name)
    return total


def complete(stack, max_tokens: int) -> dict:
    body = {"model": stack.model_id, "prompt": PROMPT, "max_tokens": max_tokens}
    resp = httpx.post(f"{stack.gateway_url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def test_token_counters_equal_the_usage_the_client_got(stack):
    prompt_before = fleet_total(stack, "tokenyard:prompt_tokens_total")
    generated_before = fleet_total(stack, "tokenyard:generation_tokens_total")
    ends_before = fleet_total(stack, "tokenyard:e2e_request_latency_seconds_count")
    usage = complete(stack, max_tokens=9)
    # The decode worker counts its last token before the gateway sees it: no wait needed.
    prompted = fleet_total(stack, "tokenyard:prompt_tokens_total") - prompt_before
    assert prompted == usage["prompt_tokens"]
    generated = fleet_total(stack, "tokenyard:generation_tokens_total") - generated_before
    assert generated == usage["completion_tokens"]
    assert fleet_total(stack, "tokenyard:e2e_request_latency_seconds_count") - ends_before == 1


def test_a_repeated_prompt_moves_the_prefix_hit_counter(stack):
    complete(stack, max_tokens=2)
    # Engine counters reach /metrics with the next heartbeat (1 s).
    assert wait_until(lambda: fleet_total(stack, "tokenyard:prefix_cache_queries_total") > 0, 10)
    hits_before = fleet_total(stack, "tokenyard:prefix_cache_hits_total")
    usage = complete(stack, max_tokens=2)
    assert usage["prompt_tokens"] >= 64
    assert wait_until(
        lambda: fleet_total(stack, "tokenyard:prefix_cache_hits_total") - hits_before >= 48, 10
    ), fleet_total(stack, "tokenyard:prefix_cache_hits_total") - hits_before
