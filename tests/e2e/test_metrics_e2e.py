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


def test_the_gateway_metrics_carry_every_workers_series(stack):
    """One scrape target for the whole fleet: the gateway's /metrics has each worker's
    tokenyard:* series, labelled by worker, beside its own."""
    complete(stack, max_tokens=3)
    text = httpx.get(f"{stack.gateway_url}/metrics", timeout=10).text
    workers: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("tokenyard:"):
                workers.setdefault(s.name, set()).add(s.labels["worker"])
    names = {w.name for w in stack.workers}
    assert workers["tokenyard:num_requests_running"] == names
    assert workers["tokenyard:kv_cache_usage_perc"] == names
    assert workers["tokenyard:prompt_tokens_total"] <= names
    up = {
        s.labels["worker"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenyard_gateway_worker_scrape_up"
    }
    assert up == dict.fromkeys(names, 1.0)
    assert "tokenyard_gateway_requests_total" in text
    # Re-exposed as they are: the gateway's count for each worker is the worker's own.
    for worker in stack.workers:
        own = httpx.get(f"{stack.ops_urls[worker.name]}/metrics", timeout=5).text
        assert total(own, "tokenyard:prompt_tokens_total") == total(
            text, "tokenyard:prompt_tokens_total", worker=worker.name
        )


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (with these labels) in a /metrics text."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    )
