"""A real gateway process on its own NATS with no router and no workers: it starts, reports
itself not ready, and answers generation with a clear 503 (never a hang, never a 500)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from tokenyard.bus.embedded import EmbeddedNats, free_port


@pytest.fixture(scope="module")
def gateway_url():
    with EmbeddedNats() as nats:
        port = free_port()
        env = {
            **os.environ,
            "TOKENYARD_GATEWAY_NATS_URL": nats.url,
            "TOKENYARD_GATEWAY_PORT": str(port),
            "TOKENYARD_GATEWAY_LOG_LEVEL": "warning",
        }
        proc = subprocess.Popen([sys.executable, "-m", "tokenyard.services.gateway"], env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"gateway exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("gateway did not become healthy")


def test_generation_is_503_with_retry_after(gateway_url):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    t0 = time.monotonic()
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=stream,
            )
        assert info.value.status_code == 503
        assert info.value.response.headers.get("retry-after")
        assert info.value.body["message"]  # OpenAI's error shape, as the client reads it
    assert time.monotonic() - t0 < 5


def test_not_ready_but_healthy(gateway_url):
    assert httpx.get(f"{gateway_url}/health").status_code == 200
    ready = httpx.get(f"{gateway_url}/ready")
    assert ready.status_code == 503
    assert ready.json()["nats_connected"] is True and ready.json()["workers"] == []
