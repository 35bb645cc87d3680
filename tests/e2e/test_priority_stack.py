"""Priority through the real stack: gateway, router, NATS, one aggregated worker with the real
model and a single sequence slot. An urgent request sent after two low-priority ones is
answered before them (the engine admits it first, preempting a less urgent running one for
its slot), each API key's tenant shows in the worker's per-tenant metrics, and a priority
out of range is a 400. With two slots, a tenant holding both gives one up (preempted,
resumed later) to another tenant's request."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.procs import wait_until
from tokenyard.services.launch.stack import LocalStack, StackConfig

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "sk-test-tenant-a", "sk-test-tenant-b"


@contextlib.contextmanager
def _tenants_stack(launch_stack, slots: int):
    """One aggregated worker of `slots` running sequences, behind a gateway with two keys."""
    config = StackConfig(
        port=free_port(),
        aggregated=True,
        workers=1,
        kvcache=False,
        facilities=False,
        telemetry=False,
        gateway_env={
            "TOKENYARD_GATEWAY_API_KEYS": f"{KEY_A},{KEY_B}",
            # A queued request streams nothing until it runs: on a loaded CPU host that may
            # take longer than the default idle timeout.
            "TOKENYARD_GATEWAY_IDLE_TIMEOUT_S": "900",
        },
        worker_env={"TOKENYARD_WORKER_MAX_NUM_SEQS": str(slots)},
    )
    with launch_stack(config) as stack:
        # LocalStack.wait_ready's /v1/models would need a key here: the same wait, then that.
        assert wait_until(lambda: _registered(stack), 600), stack.describe_failures()
        models = httpx.get(
            f"{stack.gateway_url}/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}
        )
        stack.model_id = models.json()["data"][0]["id"]
        yield stack


@pytest.fixture(scope="module")
def one_slot_stack(launch_stack):
    with _tenants_stack(launch_stack, 1) as stack:
        yield stack


def _registered(stack: LocalStack) -> bool:
    stack.check_alive()
    body = stack.ready()
    return body is not None and stack.all_workers_registered(body)


def body(stack: LocalStack, tag: str, max_tokens: int, priority: int) -> dict:
    return {
        "model": stack.model_id,
        "prompt": f"{tag}: count the stones on the shelf, one by one.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "priority": priority,
    }


def test_an_urgent_request_overtakes_queued_low_priority_ones(one_slot_stack):
    stack = one_slot_stack
    done: dict[str, float] = {}
    errors: list[str] = []
    blocker_started = threading.Event()

    def send(tag: str, key: str, max_tokens: int, priority: int) -> None:
        with httpx.stream(
            "POST",
            f"{stack.gateway_url}/v1/completions",
            json={**body(stack, tag, max_tokens, priority), "stream": True},
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    blocker_started.set()  # the first sender's first token: it holds the slot
            if resp.status_code != 200:
                errors.append(f"{tag}: {resp.status_code}")
        done[tag] = time.monotonic()

    def start(tag: str, key: str, max_tokens: int, priority: int) -> threading.Thread:
        thread = threading.Thread(target=send, args=(tag, key, max_tokens, priority))
        thread.start()
        return thread

    threads = [start("blocker", KEY_A, 48, 0)]
    assert blocker_started.wait(300)
    threads += [start("low1", KEY_A, 4, 5), start("low2", KEY_A, 4, 5)]
    time.sleep(0.2)  # queued behind the blocker before the urgent one comes
    threads.append(start("urgent", KEY_B, 4, -5))
    for thread in threads:
        thread.join(timeout=900)
    assert not errors, errors
    assert done["urgent"] < done["low1"] and done["urgent"] < done["low2"], done


def tenant_series(stack: LocalStack, name: str) -> dict[str, float]:
    url = stack.ops_urls[stack.workers[0].name]
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        s.labels["tenant"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_each_keys_tenant_has_its_queue_metrics(one_slot_stack):
    stack = one_slot_stack
    for key in (KEY_A, KEY_B):
        resp = httpx.post(
            f"{stack.gateway_url}/v1/completions",
            json=body(stack, "metrics", 2, 0),
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
    # Engine counters reach /metrics with the next heartbeat.
    assert wait_until(
        lambda: len(tenant_series(stack, "tokenyard:tenant_admitted_total")) >= 2, 10
    ), tenant_series(stack, "tokenyard:tenant_admitted_total")
    tokens = tenant_series(stack, "tokenyard:tenant_tokens_total")
    assert len(tokens) >= 2 and all(v > 0 for v in tokens.values())
    assert all(t.startswith("static:") for t in tokens)


def test_a_priority_out_of_range_is_400(one_slot_stack):
    stack = one_slot_stack
    resp = httpx.post(
        f"{stack.gateway_url}/v1/chat/completions",
        json={
            "model": stack.model_id,
            "messages": [{"role": "user", "content": "hi"}],
            "priority": 1000,
        },
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "priority"


@pytest.fixture(scope="module")
def two_slot_stack(launch_stack):
    with _tenants_stack(launch_stack, 2) as stack:
        yield stack


def test_a_quiet_tenant_takes_a_slot_from_one_holding_both(two_slot_stack):
    """Tenant A holds both slots with long requests; tenant B's short one preempts A's newer
    one, ends long before A's, and A's preempted request still completes in full."""
    stack = two_slot_stack
    done: dict[str, float] = {}
    finish: dict[str, str] = {}
    errors: list[str] = []
    started = {tag: threading.Event() for tag in ("a1", "a2")}

    def send(tag: str, key: str, max_tokens: int) -> None:
        with httpx.stream(
            "POST",
            f"{stack.gateway_url}/v1/completions",
            json={**body(stack, tag, max_tokens, 0), "stream": True},
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    if tag in started:
                        started[tag].set()
                    choice = json.loads(line[len("data: ") :])["choices"][0]
                    finish[tag] = choice.get("finish_reason") or finish.get(tag, "")
            if resp.status_code != 200:
                errors.append(f"{tag}: {resp.status_code}")
        done[tag] = time.monotonic()

    threads = [threading.Thread(target=send, args=(t, KEY_A, 96)) for t in ("a1", "a2")]
    for thread in threads:
        thread.start()
    assert all(event.wait(300) for event in started.values())  # both slots are A's
    quiet = threading.Thread(target=send, args=("b", KEY_B, 4))
    quiet.start()
    threads.append(quiet)
    for thread in threads:
        thread.join(timeout=900)
    assert not errors, errors
    assert done["b"] < done["a1"] and done["b"] < done["a2"], done
    # A's preempted request resumed and ran to its whole length
    assert finish == {"a1": "length", "a2": "length", "b": "length"}, finish
    assert wait_until(lambda: preemptions(stack) >= 1, 10), preemptions(stack)


def preemptions(stack: LocalStack) -> float:
    url = stack.ops_urls[stack.workers[0].name]
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tokenyard:num_preemptions_total"
    )
