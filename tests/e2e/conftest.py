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

from collections.abc import Iterator

import pytest

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.stack import LocalStack, StackConfig


@pytest.fixture(scope="session")
def stack(launch_stack) -> Iterator[LocalStack]:
    config = StackConfig(
        port=free_port(),
        kvcache=False,
        facilities=False,
        router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
    )
    with launch_stack(config) as s:
        s.wait_ready(timeout=300)
        yield s
