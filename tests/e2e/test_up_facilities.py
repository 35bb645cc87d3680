"""`tokenyard up` gives the facilities service an admin token and says where it is."""

from __future__ import annotations

import time

import httpx
import pytest

from tokenyard.bus.embedded import free_port
from tokenyard.services.launch.stack import LocalStack, StackConfig

pytestmark = pytest.mark.slow


def wait_health(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"facilities service at {url} never became healthy")


@pytest.mark.parametrize("preset", [None, "operator-token"])
def test_stack_facilities_admin_api_takes_the_printed_token(monkeypatch, preset):
    if preset is None:
        monkeypatch.delenv("TOKENYARD_FACILITIES_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("TOKENYARD_FACILITIES_ADMIN_TOKEN", preset)
    config = StackConfig(
        port=free_port(), aggregated=True, engine="fake", kvcache=False, gateway=False
    )
    with LocalStack(config) as stack:
        url, token = stack.facilities_url, stack.facilities_admin_token
        assert url.startswith("http://127.0.0.1:")
        assert token == preset if preset else len(token) >= 16
        wait_health(url)
        fault = {"kind": "pump_failure"}
        path = f"{url}/v1/admin/racks/rack-a/faults"
        assert httpx.post(path, json=fault, trust_env=False).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        assert httpx.post(path, json=fault, headers=bad, trust_env=False).status_code == 403
        good = {"Authorization": f"Bearer {token}"}
        assert httpx.post(path, json=fault, headers=good, trust_env=False).is_success
        assert httpx.delete(path, headers=good, trust_env=False).is_success
