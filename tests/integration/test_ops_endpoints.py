"""Every service of a local stack answers /health, /ready and /metrics on its ops port."""

from __future__ import annotations

import httpx

from tokenyard.services.launch.procs import wait_until
from tokenyard.services.launch.stack import StackConfig


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_every_service_serves_ops_endpoints(launch_stack):
    config = StackConfig(engine="fake", gateway=False, facilities=False)
    with launch_stack(config) as stack:
        assert set(stack.ops_urls) == {"router", "kvcache", "prefill-1", "decode-2"}
        for name, url in stack.ops_urls.items():
            assert wait_until(lambda url=url: _ready(url), 60), (name, stack.describe_failures())
            assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "ok"}
            metrics = httpx.get(f"{url}/metrics", timeout=5)
            assert metrics.status_code == 200
            assert "process_cpu_seconds_total" in metrics.text, name
