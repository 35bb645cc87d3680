"""The suite's shared stack: embedded NATS, router, 1 prefill + 1 decode worker, gateway.

Every service is its own process on free ports (tokenyard.services.launch.LocalStack);
the session's end stops them all (process groups; children also die with this process).

    def test_something(stack):
        stack.gateway_url, stack.nats_url, stack.model_id
        extra = stack.add_worker("decode")   # a ChildProcess: .kill() plays a crash, .stop()

The router here disaggregates every request (TOKENYARD_ROUTER_DISAGGREGATION=always)
so the suite exercises the prefill -> decode hand-off, not only the aggregated shortcut.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import openai
import pytest

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.procs import wait_until
from tokenyard.services.launch.stack import LocalStack, StackConfig


@pytest.fixture(scope="session")
def stack(launch_stack) -> Iterator[LocalStack]:
    config = StackConfig(
        port=free_port(),
        kvcache=False,
        facilities=False,
        telemetry=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
    )
    with launch_stack(config) as s:
        s.wait_ready(timeout=300)
        yield s


# An OpenAI client on the session stack (or on a running one: TOKENYARD_E2E_GATEWAY_URL),
# shared by the files that test the API through the official SDK.
@pytest.fixture(scope="module")
def url(request) -> str:
    if os.environ.get("TOKENYARD_E2E_GATEWAY_URL"):  # a stack that is already running
        return os.environ["TOKENYARD_E2E_GATEWAY_URL"]
    return request.getfixturevalue("stack").gateway_url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def telemetry_stack(launch_stack) -> Iterator[LocalStack]:
    """A stack with the facilities (example inventory) and telemetry services, for the
    console's tests: 1 prefill + 1 decode worker on rack-a and rack-b, every request split,
    the KV-cache service (the console shows the bytes moved to it), LoRA enabled."""
    config = StackConfig(
        port=free_port(),
        kvcache=True,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
        # A cleared fault lets its rack back to normal after 1 s, not the default 30 s.
        facilities_env={"TOKENYARD_FACILITIES_DWELL_S": "1"},
        # LoRA slots, empty at start: the console test loads an adapter at run time.
        worker_env={"TOKENYARD_WORKER_ENABLE_LORA": "1"},
    )
    with launch_stack(config) as s:
        s.wait_ready(timeout=300)
        assert wait_until(lambda: _ready(s.console_url), 60), s.describe_failures()
        yield s


def _ready(console_url: str) -> bool:
    try:
        return httpx.get(f"{console_url}ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
